"""Exact dedup on the engine: which documents are the first with their 128-bit text hash.

    first = first_occurrences(docs.hash_hi, docs.hash_lo, engine, work_dir, partition_mb=16)

Sorted runs, then partitions, as an external sort: the hashes are cut into runs of RUN_ROWS
documents; each run is a task that sorts its rows (hash, row) and spills them to the work folder
(a path or URL the workers reach). The hashes are cut into 2**bits ranges by their top bits
(`partition_mb` of rows each); each range is a task that reads its stretch of every run, finds
the rows whose hash an earlier row has, and returns them. So the driver holds the hashes it
already had and a flag a document, and sorts nothing. A run killed part way reuses the runs and
ranges it finished (files named by number in a folder named by the hashes). The result does not
depend on the engine, the worker count, the number of ranges or the completion order.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gristmill.core.files import names_in
from gristmill.core.stage import Engine
from gristmill.tasks.collect.output import spill

RUN_ROWS = 1 << 20  # documents sorted by one task: 24 MB of rows
_ROW = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("row", "<i8")])


@dataclass(frozen=True, kw_only=True)
class _Run:
    work_dir: str
    bits: int

    def file(self, kind: str, n: int) -> str:
        return spill.file_in(self.work_dir, kind, n)


def _sorted(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort((rows["row"], rows["lo"], rows["hi"]))]


def _run_task(item: tuple[int, np.ndarray, np.ndarray, int, bool, _Run]) -> np.ndarray:
    """Sort one run's rows into its file (unless an earlier attempt did); where each range
    starts in it."""
    k, hi, lo, first_row, done, run = item
    if done:
        keys = spill.load(run.file("run", k))["hi"]
    else:
        rows = np.empty(len(hi), _ROW)
        rows["hi"], rows["lo"], rows["row"] = hi, lo, first_row + np.arange(len(hi))
        rows = _sorted(rows)
        spill.save(run.file("run", k), rows)
        keys = rows["hi"]
    return spill.key_bounds(keys, run.bits)


def _partition_task(item: tuple[int, list[spill.Piece], bool, _Run]) -> np.ndarray:
    """The rows of one range of hashes whose hash an earlier row has, ascending (kept in a file
    for a resumed run)."""
    p, pieces, done, run = item
    if done:
        return spill.load(run.file("dups", p))
    rows = _sorted(spill.read_pieces(pieces, _ROW))
    repeated = (rows["hi"][1:] == rows["hi"][:-1]) & (rows["lo"][1:] == rows["lo"][:-1])
    dups = np.sort(rows["row"][1:][repeated])
    spill.save(run.file("dups", p), dups)
    return dups


def first_occurrences(hash_hi: np.ndarray, hash_lo: np.ndarray, engine: Engine, work_dir: str | Path,
                      partition_mb: float = 16) -> np.ndarray:
    """bool [n]: whether each row is the first with its 128-bit hash (hash_hi, hash_lo)."""
    n = len(hash_hi)
    bits = spill.partition_bits(n * _ROW.itemsize, partition_mb)
    digest = hashlib.sha256(f"{n} {bits}".encode())
    for lo in range(0, n, RUN_ROWS):
        digest.update(hash_hi[lo:lo + RUN_ROWS].tobytes() + hash_lo[lo:lo + RUN_ROWS].tobytes())
    run = _Run(work_dir=f"{work_dir}/run-{digest.hexdigest()[:16]}", bits=bits)
    done = names_in(run.work_dir, create=True)
    starts = range(0, n, RUN_ROWS)
    bounds = engine.map(_run_task, [(k, hash_hi[s:s + RUN_ROWS], hash_lo[s:s + RUN_ROWS], s,
                                     f"run-{k:06d}.npy" in done, run) for k, s in enumerate(starts)])
    parts: list[list[spill.Piece]] = [[] for _ in range(1 << bits)]
    for k, run_bounds in enumerate(bounds):
        spill.add_pieces(parts, run.file("run", k), run_bounds)
    dups = engine.map(_partition_task, [(p, pieces, f"dups-{p:06d}.npy" in done, run)
                                        for p, pieces in enumerate(parts)])
    first = np.ones(n, bool)
    for rows in dups:
        first[rows] = False
    return first
