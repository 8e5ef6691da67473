"""The persisted near-dedup index: the signatures and bucket rows of every document kept so far,
which the next refresh of the corpus dedups against (`DedupIndex`: its files and how they are
read), written by a near dedup beside its output (`write_index`), and the two steps of a run that
read or write its rows: a pair's check against an index document and a shard of the new index.
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gristmill.core.files import fetch_file
from gristmill.core.stage import Engine
from gristmill.tasks.collect.dedup.config import ROW, DedupConfig, Run
from gristmill.tasks.collect.output import spill

INDEX_FORMAT = 3  # 3: bucket rows in key-sorted shards (2: one band-key matrix)
_PAIRS_PER_BLOCK = 65_536  # candidate pairs verified at once against the index's signatures
BLOCK_ROWS = 65_536  # rows copied at once into the new index's files
_INDEX_FIELDS = ("shingle_words", "bands", "rows", "band_layouts", "seed")  # signature settings


@dataclass(frozen=True, kw_only=True)
class DedupIndex:
    """The signatures and bucket rows of every document kept so far, on disk: index.json (written
    last), ids.npy, signatures.npy and `buckets-NNNNNN.npy`, shard p holding the bucket rows whose
    keys' top `bits` bits are p, sorted by key. Read memory-mapped: a refresh reads the rows of
    its partitions' key ranges and the signatures of its candidate pairs, not the whole index."""

    directory: Path
    location: str  # where workers read the shards (the directory, or its place on a bucket)
    shingle_words: int
    bands: int
    rows: int
    band_layouts: int
    seed: int
    docs: int
    bits: int

    def __len__(self) -> int:
        return self.docs

    @property
    def ids(self) -> np.ndarray:
        return np.load(self.directory / "ids.npy", mmap_mode="r")

    @property
    def signatures(self) -> np.ndarray:
        return np.load(self.directory / "signatures.npy", mmap_mode="r")

    def shard(self, p: int) -> np.ndarray:
        return np.load(self.directory / f"buckets-{p:06d}.npy", mmap_mode="r")

    def check_compatible(self, cfg: DedupConfig) -> None:
        """ValueError naming the first config field the stored signatures disagree with."""
        for name in _INDEX_FIELDS:
            if getattr(self, name) != getattr(cfg, name):
                raise ValueError(f"{name}: the index was built with {getattr(self, name)}, the "
                                 f"config says {getattr(cfg, name)}; rebuild the index")

    def pieces(self, bits: int) -> list[list[spill.Piece]]:
        """For each of 2**bits key ranges, the stretches of the index's shards that fall in it
        (found by binary search on the memory-mapped keys)."""
        out: list[list[spill.Piece]] = [[] for _ in range(1 << bits)]
        for q in range(1 << self.bits):
            spill.add_pieces(out, f"{self.location}/buckets-{q:06d}.npy",
                             spill.key_bounds(self.shard(q)["key"], bits))
        return out

    @classmethod
    def load(cls, directory: Path, location: str | None = None) -> DedupIndex:
        directory = Path(directory)
        meta_path = directory / "index.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path}: no dedup index here (index.json is missing)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != INDEX_FORMAT:
            raise ValueError(f"{meta_path}: index format {meta.get('format')}, this version reads "
                             f"format {INDEX_FORMAT} only; rebuild the index (rerun the collect "
                             f"stage that wrote it)")
        index = cls(directory=directory, location=location or str(directory), docs=meta["docs"],
                    bits=meta["bits"], **{name: meta[name] for name in _INDEX_FIELDS})
        expected = {"ids.npy": ((index.docs,), index.ids.shape),
                    "signatures.npy": ((index.docs, index.bands * index.rows), index.signatures.shape),
                    "buckets-*.npy": ((index.docs * index.bands * index.band_layouts,),
                                      (sum(len(index.shard(q)) for q in range(1 << index.bits)),))}
        for name, (shape, found) in expected.items():
            if shape != found:
                raise ValueError(f"{directory / name}: shape {found}, index.json implies {shape}")
        return index

def index_shard_task(item: tuple[int, list[spill.Piece], np.ndarray, Run]) -> str:
    """The new index's rows of one key range: the old index's and those of this input's documents
    it keeps (renumbered after the old index, in input order; `excluded`: the input positions it
    does not keep, ascending). Returns the file it wrote."""
    p, pieces, excluded, run = item
    rows = spill.read_pieces(pieces, ROW)
    position = rows["node"] - run.m
    mine = position >= 0
    dropped = np.zeros(len(rows), bool)
    if len(excluded):
        at = np.minimum(np.searchsorted(excluded, position[mine]), len(excluded) - 1)
        dropped[mine] = excluded[at] == position[mine]
    rows = rows[~dropped]
    mine = rows["node"] >= run.m
    rows["node"][mine] -= np.searchsorted(excluded, rows["node"][mine] - run.m)
    rows = rows[np.lexsort((rows["node"], rows["col"], rows["key"]))]
    spill.save(run.file("bucket", p), rows)
    return run.file("bucket", p)

def index_verify(pairs: np.ndarray, index: DedupIndex, run: Run) -> np.ndarray:
    """The pairs (index doc, input doc) with at least `threshold` of their signature values equal
    (the MinHash estimate: the index keeps no shingles), read a block at a time."""
    kept = [np.zeros((0, 2), np.int64)]
    min_equal = math.ceil(run.cfg.threshold * run.cfg.num_perm - 1e-9)
    for lo in range(0, len(pairs), _PAIRS_PER_BLOCK):
        block = pairs[lo:lo + _PAIRS_PER_BLOCK]
        inputs = block[:, 1] - run.m
        chunks = inputs // run.cfg.chunk_docs
        mine = np.empty((len(block), run.cfg.num_perm), np.uint32)
        for chunk in np.unique(chunks).tolist():
            at = chunks == chunk
            mine[at] = spill.load(run.file("sig", chunk))[inputs[at] - chunk * run.cfg.chunk_docs]
        kept.append(block[(index.signatures[block[:, 0]] == mine).sum(axis=1) >= min_equal])
    return np.concatenate(kept)

def write_index(run: Run, index: DedupIndex | None, ids: Sequence[str], excluded: np.ndarray,
                 parts: list[list[spill.Piece]], engine: Engine, index_dir: Path) -> DedupIndex:
    """The old index plus the input documents not `excluded`, in `index_dir` (index.json last):
    ids and signatures copied a block at a time, the bucket shards written on the engine."""
    index_dir.mkdir(parents=True, exist_ok=True)
    m, n, cfg = run.m, len(ids), run.cfg
    kept = np.ones(n, bool)
    kept[excluded] = False
    total = m + int(kept.sum())
    width = max([1, index.ids.dtype.itemsize // 4 if index else 1]
                + [max(map(len, ids[lo:lo + BLOCK_ROWS])) for lo in range(0, n, BLOCK_ROWS)])

    def old_rows(array: np.ndarray) -> Iterator[np.ndarray]:
        return (array[lo:lo + BLOCK_ROWS] for lo in range(0, m, BLOCK_ROWS))

    chunks = list(enumerate(range(0, n, cfg.chunk_docs)))
    new_ids = ([ids[start + i] for i in np.flatnonzero(kept[start:start + cfg.chunk_docs]).tolist()]
               for _, start in chunks)
    new_sigs = (spill.load(run.file("sig", c))[kept[start:start + cfg.chunk_docs]] for c, start in chunks)
    spill.write_npy(index_dir / "ids.npy", np.dtype(f"<U{width}"), (total,),
               itertools.chain(old_rows(index.ids) if index else (), new_ids))
    spill.write_npy(index_dir / "signatures.npy", np.dtype(np.uint32), (total, cfg.num_perm),
               itertools.chain(old_rows(index.signatures) if index else (), new_sigs))
    shards = engine.map(index_shard_task, [(p, pieces, excluded, run) for p, pieces in enumerate(parts)])
    for p, shard in enumerate(shards):
        fetch_file(shard, index_dir / f"buckets-{p:06d}.npy")
    meta = {"format": INDEX_FORMAT, "docs": total, "bits": run.bits,
            **{name: getattr(cfg, name) for name in _INDEX_FIELDS}}
    (index_dir / "index.json").write_text(json.dumps(meta, indent=2) + "\n")
    return DedupIndex.load(index_dir)
