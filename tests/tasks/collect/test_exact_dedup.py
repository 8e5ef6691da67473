"""Exact dedup on the engine (tasks/collect/dedup/exact_dedup.py): the first row of each 128-bit hash
wins, whatever the runs, ranges, engine or completion order, and a killed run resumes."""
from __future__ import annotations

import numpy as np
import pytest
from corpus_helpers import DiesPartWay, ShuffledEngine

import gristmill.tasks.collect.dedup.exact_dedup as exact_dedup
from gristmill.core.stage import SerialEngine


def _hashes(n: int, distinct: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n hashes drawn from `distinct` values, some sharing their first 64 bits only."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**63, (distinct, 2), dtype=np.int64).astype(np.uint64) << np.uint64(1)
    values[1::7, 0] = values[0::7, 0][:len(values[1::7])]  # same hi, other lo: not duplicates
    picks = rng.integers(0, distinct, n)
    return values[picks, 0], values[picks, 1]


def _first_by_dict(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    seen: set[tuple[int, int]] = set()
    first = []
    for key in zip(hi.tolist(), lo.tolist()):
        first.append(key not in seen)
        seen.add(key)
    return np.array(first)


def test_first_occurrences_for_any_runs_ranges_and_order(monkeypatch, tmp_path):
    hi, lo = _hashes(5000, 3000)
    expected = _first_by_dict(hi, lo)
    assert 0 < (~expected).sum() < 5000 and len(np.unique(hi[expected])) < expected.sum()
    base = exact_dedup.first_occurrences(hi, lo, SerialEngine(), tmp_path / "one")
    assert np.array_equal(base, expected)
    monkeypatch.setattr(exact_dedup, "RUN_ROWS", 333)  # 16 runs
    for n, (engine, mb) in enumerate(((ShuffledEngine(1), 0.01), (ShuffledEngine(2), 0.001))):
        assert np.array_equal(exact_dedup.first_occurrences(hi, lo, engine, tmp_path / str(n), mb), expected)
    assert len(list((tmp_path / "1").glob("run-*/dups-*.npy"))) == 128  # 120 KB of rows in 1 KB ranges


def test_a_killed_exact_dedup_redoes_only_its_unfinished_runs_and_ranges(monkeypatch, tmp_path):
    monkeypatch.setattr(exact_dedup, "RUN_ROWS", 500)
    hi, lo = _hashes(4000, 2500)
    work, mb = tmp_path / "spill", 0.02  # 8 runs, 8 ranges
    with pytest.raises(RuntimeError, match="killed"):
        exact_dedup.first_occurrences(hi, lo, DiesPartWay(exact_dedup._run_task, 5), work, mb)
    with pytest.raises(RuntimeError, match="killed"):
        first = DiesPartWay(exact_dedup._partition_task, 3)
        exact_dedup.first_occurrences(hi, lo, first, work, mb)
    assert first.done["exact_dedup._run_task"] == [True] * 5 + [False] * 3
    resumed = DiesPartWay()
    result = exact_dedup.first_occurrences(hi, lo, resumed, work, mb)
    assert resumed.done == {"exact_dedup._run_task": [True] * 8,
                            "exact_dedup._partition_task": [True] * 3 + [False] * 5}
    assert np.array_equal(result, _first_by_dict(hi, lo))
    other = exact_dedup.first_occurrences(hi[:-1], lo[:-1], DiesPartWay(), work, mb)  # its own files
    assert np.array_equal(other, _first_by_dict(hi[:-1], lo[:-1]))
