"""The store fuzzer (bench/harness/store_fuzz.py) at store level, on a copy of the tiny run's store: 260
seeded trials of random damage (20 of each kind), each named by `verify` and refused for reuse,
nothing else reported (how long that takes is for `python -m bench store-fuzz` to measure). And
the fuzzer can fail: with a check of the store switched off, the kinds of damage only that check
sees go undetected."""
from __future__ import annotations

from pathlib import Path

import pytest

import gristmill.infra.artifacts as artifacts
import gristmill.infra.integrity as integrity
from bench.harness.store_damage import KINDS
from bench.harness.store_fuzz import run_trials

TRIALS = 20 * len(KINDS)


@pytest.fixture(scope="module")
def finished_store(tiny_run, tmp_path_factory) -> Path:
    """The tiny run's committed outputs, alone in a home of their own (other tests add to its home)."""
    return tiny_run.home_with(tmp_path_factory.mktemp("store-fuzz") / "home") / "artifacts"


@pytest.mark.slow
def test_every_damage_is_named_by_verify_and_refused_for_reuse(finished_store, tmp_path):
    results = run_trials(finished_store, tmp_path, TRIALS, seed=0)
    assert [t.kind for t in results] == [*KINDS] * 20
    assert [(t.kind, t.what, t.spurious) for t in results if not t.detected] == []
    # the default reuse (size) passes only same-size changes of big files, which it does not hash
    assert all(t.refused_size or t.unhashed for t in results)


@pytest.mark.slow
@pytest.mark.parametrize("module, check, off, kinds, rounds", [
    (artifacts, "unlisted", lambda directory, listed: {}, {"add_file", "add_folder", "rename_file"}, 2),
    (integrity, "seal_of", lambda record: record.get("seal"), {"edit_field"}, 2),
    # with seed 0, 2 draws of unreadable damage were each detected without the mode check; 20 include one that is not
    (integrity, "_unreadable_mode", lambda mode, folder=False: None, {"unreadable"}, 20),
])
def test_the_fuzzer_fails_when_a_check_is_switched_off(finished_store, tmp_path, monkeypatch, module, check, off,
                                                       kinds, rounds):
    """`rounds` trials of each kind of damage, in the order of the 260."""
    monkeypatch.setattr(module, check, off)
    results = run_trials(finished_store, tmp_path, rounds * len(KINDS), seed=0)
    assert kinds <= {t.kind for t in results if not t.detected}
