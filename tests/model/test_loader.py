"""The packed, seeded, resumable, rank-sharded token loader (model/data.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from gristmill.model.data import PackedTokenLoader, count_windows, window_starts

SEQ = 8


def _tokens(n: int = 8 * 50 + 1) -> np.ndarray:
    return np.arange(n, dtype=np.uint16)  # token value == its offset, so windows reveal their start


def _epoch_starts(loader: PackedTokenLoader, epoch: int) -> list[int]:
    return [int(loader[epoch * len(loader) + i][0]) for i in range(len(loader))]


def test_windows_are_packed_next_token_pairs_covering_every_token():
    tokens = _tokens()
    loader = PackedTokenLoader(tokens, SEQ, seed=3)
    assert len(loader) == count_windows(len(tokens), SEQ) == 50
    starts = _epoch_starts(loader, 0)
    assert sorted(starts) == list(range(0, 50 * SEQ, SEQ))  # a permutation of all windows
    assert starts != sorted(starts)
    window = loader[0]
    assert window.dtype == np.int64 and window.shape == (SEQ + 1,)
    assert np.array_equal(window, np.arange(window[0], window[0] + SEQ + 1))
    # Consecutive windows share one token: every token after the first is a target once per epoch.
    targets = np.concatenate([tokens[s + 1 : s + SEQ + 1] for s in starts])
    assert sorted(targets.tolist()) == list(range(1, len(tokens)))


def test_order_is_deterministic_by_seed_and_changes_per_epoch():
    a, b = PackedTokenLoader(_tokens(), SEQ, seed=3), PackedTokenLoader(_tokens(), SEQ, seed=3)
    assert _epoch_starts(a, 0) == _epoch_starts(b, 0)
    assert _epoch_starts(a, 0) != _epoch_starts(a, 1)
    assert _epoch_starts(a, 0) != _epoch_starts(PackedTokenLoader(_tokens(), SEQ, seed=4), 0)
    # A batch crossing the epoch boundary is the tail of one epoch and the head of the next.
    batch = a.batch(len(a) - 2, 4)[:, 0].tolist()
    assert batch == _epoch_starts(a, 0)[-2:] + _epoch_starts(a, 1)[:2]


def test_saved_position_resumes_exactly():
    straight = PackedTokenLoader(_tokens(), SEQ, seed=1)
    expected = [straight.next_batch(16) for _ in range(7)]  # 112 windows: crosses two epochs

    first = PackedTokenLoader(_tokens(), SEQ, seed=1)
    got = [first.next_batch(16) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    assert (state["epoch"], state["index"]) == (0, 48)
    resumed = PackedTokenLoader(_tokens(), SEQ, seed=1)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(16) for _ in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(expected, got))
    with pytest.raises(ValueError, match="seed"):
        PackedTokenLoader(_tokens(), SEQ, seed=2).load_state_dict(state)


def test_two_ranks_read_disjoint_windows_covering_the_epoch():
    for epoch in (0, 1):
        ranks = [PackedTokenLoader(_tokens(), SEQ, seed=5, rank=r, world_size=2) for r in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]) == 25
        seen = [set(_epoch_starts(loader, epoch)) for loader in ranks]
        assert len(seen[0]) == len(seen[1]) == 25 and seen[0].isdisjoint(seen[1])
        assert seen[0] | seen[1] == set(range(0, 50 * SEQ, SEQ))
    # Rank r of the split stream reads every world_size-th window of the single-reader order.
    single = _epoch_starts(PackedTokenLoader(_tokens(), SEQ, seed=5), 0)
    assert _epoch_starts(PackedTokenLoader(_tokens(), SEQ, seed=5, rank=1, world_size=2), 0) == single[1::2]


def test_odd_window_count_drops_at_most_world_size_minus_one_per_epoch():
    tokens = _tokens(8 * 51 + 1)  # 51 windows, 2 ranks: 25 each, one skipped
    seen = [set(_epoch_starts(PackedTokenLoader(tokens, SEQ, seed=0, rank=r, world_size=2), 0)) for r in (0, 1)]
    assert seen[0].isdisjoint(seen[1]) and len(seen[0] | seen[1]) == 50


def test_rejects_bad_rank_and_too_little_data():
    with pytest.raises(ValueError, match="rank"):
        PackedTokenLoader(_tokens(), SEQ, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        PackedTokenLoader(_tokens(SEQ + 1), SEQ, world_size=2)
    with pytest.raises(ValueError, match="windows"):
        window_starts(SEQ, SEQ, seed=0, position=0, count=1)


def test_from_dir_memory_maps_the_split(tmp_path):
    np.arange(100, dtype=np.uint32).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32"}))
    loader = PackedTokenLoader.from_dir(tmp_path, seq_len=9, seed=0)
    assert isinstance(loader.tokens, np.memmap) and len(loader) == 11
    assert loader[0][1] == loader[0][0] + 1
