"""Arrays spilled to files by the collect stage's corpus-level steps on the engine (exact dedup's
hashes, near dedup's signatures and bucket rows): .npy files at a path or a URL every worker
reaches, each put there whole once written, so a file that exists is finished and a killed run
reuses it. Rows sorted by a 64-bit key are cut into 2**bits ranges by the key's top bits; a
range's task reads its stretch of every file (`Piece`) by seeking, not the whole file."""
from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from gristmill.core.files import open_location, publish_file, staging_path

Piece = tuple[str, int, int]  # rows lo..hi of a spilled .npy file


def save(location: str, array: np.ndarray) -> None:
    """`array` as a .npy file at a path or URL, put there whole once written."""
    tmp = staging_path(location, ".tmp.npy")  # np.save adds .npy to a name without it
    np.save(tmp, array, allow_pickle=False)
    publish_file(tmp, location)


def file_in(work_dir: str, kind: str, n: int) -> str:
    """The location of a step's n-th spilled file of a kind (`run`, `rows`, ...) in its work folder."""
    return f"{work_dir}/{kind}-{n:06d}.npy"


def load(location: str) -> np.ndarray:
    with open_location(location) as f:
        return np.load(f, allow_pickle=False)


def write_npy(path: Path, dtype: np.dtype, shape: tuple[int, ...], blocks: Iterable[Any]) -> None:
    """A .npy file of `shape` written a block of rows at a time (plain writes: a memory map's
    written pages would count in this process's resident memory)."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_2_0(f, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                 "fortran_order": False, "shape": shape})
        for block in blocks:
            f.write(np.ascontiguousarray(block, dtype).tobytes())


def read_rows(location: str, lo: int, hi: int) -> np.ndarray:
    """Rows lo..hi of a .npy file at a path or URL, read by seeking past the others."""
    with open_location(location) as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) \
            else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        f.seek(f.tell() + lo * row_bytes)
        data = f.read((hi - lo) * row_bytes)
    return np.frombuffer(data, dtype).reshape(hi - lo, *shape[1:])


def read_pieces(pieces: list[Piece], dtype: np.dtype) -> np.ndarray:
    """The rows of every piece, concatenated."""
    return np.concatenate([np.zeros(0, dtype)] + [read_rows(*piece) for piece in pieces])


def key_bounds(keys: np.ndarray, bits: int) -> np.ndarray:
    """Where each of the 2**bits key ranges (range p: the keys whose top `bits` bits are p)
    starts in ascending uint64 `keys`, and their end: int64 [2**bits + 1]."""
    starts = [np.uint64(p << (64 - bits)) for p in range(1, 1 << bits)] if bits else []
    return np.r_[0, np.searchsorted(keys, np.array(starts, np.uint64)), len(keys)].astype(np.int64)


def add_pieces(parts: list[list[Piece]], location: str, bounds: np.ndarray) -> None:
    """Append to each range's pieces the stretch of the file at `location` that `bounds` (from
    `key_bounds`) gives it, when not empty."""
    for p in np.flatnonzero(np.diff(bounds)).tolist():
        parts[p].append((location, int(bounds[p]), int(bounds[p + 1])))


def partition_bits(row_bytes: int, partition_mb: float) -> int:
    """Enough key ranges that each holds about `partition_mb` of the `row_bytes` spilled."""
    return max(0, math.ceil(math.log2(max(1.0, row_bytes / (partition_mb * 1e6)))))
