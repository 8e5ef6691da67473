"""Memory-mapped pretraining data: packed windows, seeded epochs, a resumable position, rank shards.

The token stream (`tokens/train.bin`: documents each followed by `<|endoftext|>`) is cut into
windows of `seq_len + 1` tokens; window `w` covers tokens `[w * seq_len, w * seq_len + seq_len + 1)`.
Consecutive windows share one token, so every token but the first is a next-token target exactly
once per epoch. Windows run across document boundaries (packing, no padding); the separators stay
in, so the model learns where a document ends.

`load_tokens`, `train_starts`, `windows_batch` and `spaced_batches` turn a split into training and
validation batches; pretraining reads them, and SFT mixes the same windows into its batches.

Order: epoch `e` visits the windows in a permutation drawn from `(seed, e)`. A reader's position
`p` is a count of windows it has consumed: epoch `p // per_rank`, permutation slot
`rank + world_size * (p % per_rank)`. Ranks therefore read disjoint windows, and the position is
all a resume needs. When the window count is not a multiple of `world_size`, the permutation's
last few windows are skipped that epoch (different ones each epoch).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch


def count_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens (stride seq_len) that fit in `n_tokens` tokens."""
    return max(0, (n_tokens - 1) // seq_len)


@functools.lru_cache(maxsize=4)
def epoch_order(n_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The window indices of one epoch, in visiting order (read-only; cached, as every batch of
    the epoch needs it)."""
    order = np.random.default_rng((seed, epoch)).permutation(n_windows)
    order.flags.writeable = False
    return order


def window_starts(n_tokens: int, seq_len: int, seed: int, position: int, count: int,
                  rank: int = 0, world_size: int = 1) -> np.ndarray:
    """Token offsets of the `count` windows `rank` reads from stream position `position` on:
    a pure function of its arguments, so a resumed run reads exactly what it would have read."""
    n_windows = count_windows(n_tokens, seq_len)
    per_rank = n_windows // world_size
    if per_rank < 1:
        raise ValueError(f"{n_tokens} tokens give {n_windows} windows of {seq_len} + 1 tokens, "
                         f"fewer than world_size={world_size}")
    epochs, slots = np.divmod(np.arange(position, position + count), per_rank)
    windows = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        here = epochs == epoch
        windows[here] = epoch_order(n_windows, seed, int(epoch))[rank + world_size * slots[here]]
    return windows * seq_len


def read_tokens(tokens_dir: Path, split: str) -> np.ndarray:
    """The memory-mapped flat token ids of `split` ("train" or "val"), dtype from meta.json."""
    meta = json.loads((Path(tokens_dir) / "meta.json").read_text())
    return np.memmap(Path(tokens_dir) / f"{split}.bin", dtype=np.dtype(meta["dtype"]), mode="r")


class PackedTokenLoader:
    """Random-access, seeded, resumable reader of packed windows for one data-parallel rank.

    `loader[p]` is the window at stream position `p` (int64, seq_len + 1 tokens); `next_batch`
    reads from the current position and advances it; `state_dict` / `load_state_dict` save and
    restore that position."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.n_windows = count_windows(len(tokens), seq_len)
        if self.n_windows < world_size:
            raise ValueError(f"{len(tokens)} tokens give {self.n_windows} windows of seq_len + 1 = "
                             f"{seq_len + 1} tokens, fewer than world_size={world_size}")
        self.position = 0

    @classmethod
    def from_dir(cls, tokens_dir: Path, seq_len: int, split: str = "train", **kwargs: Any) -> PackedTokenLoader:
        return cls(read_tokens(tokens_dir, split), seq_len, **kwargs)

    def __len__(self) -> int:
        """Windows this rank reads per epoch."""
        return self.n_windows // self.world_size

    def starts(self, position: int, count: int) -> np.ndarray:
        return window_starts(len(self.tokens), self.seq_len, self.seed, position, count,
                             self.rank, self.world_size)

    def batch(self, position: int, batch_size: int) -> np.ndarray:
        """Windows at positions `position .. position + batch_size - 1`, shape (batch, seq_len + 1)."""
        return np.stack([self.tokens[s : s + self.seq_len + 1] for s in self.starts(position, batch_size)]
                        ).astype(np.int64)

    def __getitem__(self, position: int) -> np.ndarray:
        return self.batch(position, 1)[0]

    def next_batch(self, batch_size: int) -> np.ndarray:
        out = self.batch(self.position, batch_size)
        self.position += batch_size
        return out

    def state_dict(self) -> dict[str, int]:
        epoch, index = divmod(self.position, len(self))
        return {"epoch": epoch, "index": index, "seed": self.seed, "seq_len": self.seq_len,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "seq_len", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"saved position has {key}={state[key]}, this loader {getattr(self, key)}")
        self.position = state["epoch"] * len(self) + state["index"]


def load_tokens(tokens_dir: Path, split: str, seq_len: int) -> np.ndarray:
    """Memory-mapped token ids of `split` ("train" or "val"), checked to hold at least one window."""
    data = read_tokens(tokens_dir, split)
    path = Path(tokens_dir) / f"{split}.bin"
    if len(data) < seq_len + 2:
        raise ValueError(f"{path} holds {len(data)} tokens, fewer than seq_len + 2 = {seq_len + 2}; "
                         "lower seq_len or tokenize more text")
    return data


def windows_batch(data: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, torch.Tensor]:
    """Inputs and next-token labels from windows of seq_len + 1 tokens starting at `starts`."""
    windows = torch.from_numpy(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64))
    return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}


def train_starts(n_tokens: int, seq_len: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Window starts of training step `step`: a pure function of (seed, step). The whole global
    batch is read as rank 0 of 1; the training loop splits it across data-parallel processes."""
    return window_starts(n_tokens, seq_len, seed, position=step * batch_size, count=batch_size)


def spaced_batches(data: np.ndarray, seq_len: int, windows: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """A fixed evaluation set: `windows` evenly spaced windows of `data`, in batches of batch_size."""
    starts = np.linspace(0, len(data) - seq_len - 1, num=windows).astype(np.int64)
    return [windows_batch(data, starts[i : i + batch_size], seq_len) for i in range(0, len(starts), batch_size)]
