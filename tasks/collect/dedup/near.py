"""Near-duplicate detection for the collect stage: MinHash signatures, LSH banding, clusters.

    result = near_dedup(texts, DedupConfig(), engine, index=DedupIndex.load(old_dir), ids=doc_ids,
                        work_dir=spill_dir, index_dir=new_dir)  # new_dir: the next refresh's index
    kept = [t for t, k in zip(texts, result.keep) if k]

Steps (each vectorized with numpy over a chunk of documents; 1-4 in minhash.py):
  1. normalize: lowercase, punctuation and symbols become spaces, whitespace collapses;
  2. shingle: every run of `shingle_words` consecutive words, hashed (deterministic 64-bit hashes,
     never Python's salted `hash()`);
  3. MinHash: `bands * rows` hash permutations, the minimum of each over a document's shingles;
  4. LSH: a band's `rows` values hash to a bucket key; documents sharing a key in any band (of
     either band layout, see minhash.band_keys) are candidate pairs; a candidate pair counts as
     a near-duplicate only if the exact Jaccard similarity of its two shingle sets is >=
     `threshold` (against a document of the persisted index, which keeps no shingles: the
     fraction of equal signature values, the MinHash estimate);
  5. clusters: connected components of the verified pairs. Exactly one document per cluster
     survives: one already in the persisted index if the cluster holds one, else the earliest
     in input order.

Where it runs, so that the driver holds nothing per document but a flag: each chunk of documents
is a task on the engine that spills its signatures and its bucket rows (key, band, document),
sorted by key, to files in the work folder; the keys are cut into 2**bits ranges by their top bits
(`partition_mb` of rows each), and each range is a task that reads its stretch of every chunk's
rows file (and of the index's shard) and pairs the documents of each bucket. Only the candidate
pairs come back; the exact check runs in blocks of pairs on the engine, and the components are
found over the nodes of verified pairs. A run killed part way reuses the chunks and ranges it
finished (files named by chunk and range in a folder named by the input). Every step is
order-free, so the result is the same for any engine, worker count, partition count or
completion order.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.files import fetch_file, names_in
from core.stage import Engine
from tasks.collect.dedup.minhash import (
    EMPTY_SIG,
    chunk_signatures,
    exact_jaccards,
    shingle_sets,
)
from tasks.collect.output import spill
from tasks.collect.output.spool import take

INDEX_FORMAT = 3  # 3: bucket rows in key-sorted shards (2: one band-key matrix)
_U64 = np.uint64
_ROW = np.dtype([("key", "<u8"), ("col", "<u2"), ("node", "<i8")])  # a bucket row: 18 bytes
_PAIRS_PER_BLOCK = 65_536  # candidate pairs verified at once against the index's signatures
# pairs of input documents checked exactly at once, a task each: both shingle sets of each (~300
# 8-byte hashes for a 300-word page) are sorted together, so a block holds ~10 MB per temporary;
# small enough that a corpus's few blocks still keep every worker busy to the end
_EXACT_PAIRS_PER_BLOCK = 2_048
_PAIRED_PER_BUCKET = 8  # a bucket's node is paired with at most this many earlier nodes
_BLOCK_ROWS = 65_536  # rows copied at once into the new index's files


class DedupConfig(BaseModel):
    """How documents are shingled, hashed and judged near-duplicate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shingle_words: int = Field(default=5, ge=1, description="Words per shingle (word n-gram size).")
    # A pair of Jaccard similarity s shares a bucket in at least one band of one layout with
    # probability about 1 - (1 - s**rows)**(bands * band_layouts) (the second layout's bands
    # share one value with each of `rows` first-layout bands, so they are nearly independent):
    # for 18 x 6 and two layouts 0.43 at s=0.5, 0.82 at 0.6, 0.99 at 0.7 (one layout: 0.25,
    # 0.58, 0.90). The exact-Jaccard check then decides, so more candidates cost time, never
    # precision. Measured on neardup_set.py (seeds 0-3, 1,976-2,011 docs; docs/benchmarks.md#near-dedup),
    # precision 1.0 everywhere; recall 0.95-0.96 with one layout checked at 0.6, 0.97-0.98 with
    # two, 0.98-0.99 with two checked at 0.55 (datatrove at 18 x 6, no check: 0.955-0.972).
    # Below 0.55 the labelled set gains little and real pages sharing only a site's navigation
    # (0.49 in that set) come close.
    bands: int = Field(default=18, ge=1, description="LSH bands; bands x rows = hash permutations.")
    rows: int = Field(default=6, ge=1, description="Signature values per band (all must match for two "
                                                   "documents to share the band's bucket).")
    band_layouts: int = Field(default=2, ge=1, le=2, description="Ways the signature is cut into bands "
                                                                 "(1: consecutive values; 2: also one "
                                                                 "value of each of `rows` bands).")
    threshold: float = Field(default=0.55, gt=0, le=1, description="Jaccard similarity of shingle sets "
                                                                    "at or above which two documents are "
                                                                    "near-duplicates (exact for two input "
                                                                    "documents, estimated from the "
                                                                    "signatures against the index).")
    seed: int = Field(default=1, ge=0, description="Seed of the hash permutations. Signatures (and a "
                                                   "persisted index) are comparable only under one seed.")
    chunk_docs: int = Field(default=1024, ge=1, description="Documents per signature task (independent "
                                                            "of the worker count; results do not change).")
    partition_mb: float = Field(default=16, gt=0, description="Spilled rows per partition task: near "
                                                               "dedup's bucket rows (18 bytes a band of a "
                                                               "document, index included) and exact "
                                                               "dedup's hashes (24 bytes a document); "
                                                               "smaller: more tasks for the workers to "
                                                               "share, each holding less. Results do not "
                                                               "change; the index's shards do.")

    @model_validator(mode="after")
    def _check_permutations(self) -> DedupConfig:
        if self.bands * self.rows > 4096:
            raise ValueError(f"bands x rows: {self.bands} x {self.rows} = "
                             f"{self.bands * self.rows} permutations; use at most 4096")
        return self

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    def lsh_threshold(self) -> float:
        """Jaccard similarity where the banding S-curve is steepest, about (1/bands)**(1/rows)."""
        return (1 / self.bands) ** (1 / self.rows)


@dataclass(frozen=True, kw_only=True)
class _Run:
    """Where one near dedup keeps its spilled files (a path or URL its workers reach; a killed
    run's finished chunks and partitions are reused from here), and how they are cut."""

    work_dir: str
    cfg: DedupConfig
    bits: int  # 2**bits partitions of the bucket keys, by their top bits
    m: int  # index documents: nodes 0..m-1; input document i is node m + i

    def file(self, kind: str, n: int) -> str:
        return spill.file_in(self.work_dir, kind, n)


def _bucket_rows(keys: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Bucket rows of documents' keys [n, columns], sorted by key (then column, then node)."""
    rows = np.empty(keys.size, _ROW)
    rows["key"] = keys.ravel()
    rows["col"] = np.tile(np.arange(keys.shape[1], dtype=np.uint16), len(keys))
    rows["node"] = np.repeat(nodes, keys.shape[1])
    return rows[np.lexsort((rows["node"], rows["col"], rows["key"]))]


def _chunk_task(item: tuple[Sequence[str], int, int, bool, _Run]) -> tuple[np.ndarray, np.ndarray]:
    """Signatures of one chunk of documents (sig file) and their bucket rows sorted by key (rows
    file), unless an earlier attempt wrote them. Returns which documents have words (a real
    signature holds 108 values of 2**32, not all the maximum) and where each partition's rows
    start in the rows file."""
    texts, chunk, first, done, run = item
    if done:
        sigs, rows = spill.load(run.file("sig", chunk)), spill.load(run.file("rows", chunk))
    else:
        sigs, keys = chunk_signatures((texts, run.cfg))  # a lazy view of spooled texts is read here
        active = ~(sigs == EMPTY_SIG).all(axis=1)
        rows = _bucket_rows(keys[active], run.m + first + np.flatnonzero(active))
        spill.save(run.file("rows", chunk), rows)
        spill.save(run.file("sig", chunk), sigs)  # last: marks the chunk done
    return ~(sigs == EMPTY_SIG).all(axis=1), spill.key_bounds(rows["key"], run.bits)


def _pairs_in_buckets(rows: np.ndarray) -> np.ndarray:
    """Candidate pairs [k, 2] (smaller node first) from bucket rows sorted by (key, col, node):
    in each bucket, every node paired with each of the first _PAIRED_PER_BUCKET nodes before it.
    All pairs of a small bucket, so a near-duplicate is not lost because the bucket's first node
    fails the Jaccard check with it; a bound for the huge buckets that boilerplate makes."""
    n = len(rows)
    if n == 0:
        return np.zeros((0, 2), np.int64)
    new_bucket = np.r_[True, (rows["key"][1:] != rows["key"][:-1]) | (rows["col"][1:] != rows["col"][:-1])]
    head = np.flatnonzero(new_bucket)
    group_start = np.repeat(head, np.diff(np.r_[head, n]))
    n_earlier = np.minimum(np.arange(n) - group_start, _PAIRED_PER_BUCKET)
    right = np.repeat(np.arange(n), n_earlier)
    left = np.repeat(group_start, n_earlier) + (
        np.arange(len(right)) - np.repeat(np.cumsum(n_earlier) - n_earlier, n_earlier))
    nodes = rows["node"]
    return np.stack([nodes[left], nodes[right]], axis=1)


def _distinct(pairs: np.ndarray) -> np.ndarray:
    """The distinct pairs [k, 2] of nodes, sorted (each row coded as one int64)."""
    n_nodes = int(pairs.max()) + 1 if len(pairs) else 1
    return np.stack(np.divmod(np.unique(pairs[:, 0] * n_nodes + pairs[:, 1]), n_nodes), axis=1)


def _partition_task(item: tuple[int, list[spill.Piece], bool, _Run]) -> np.ndarray:
    """Distinct candidate pairs [k, 2] of one partition of the bucket keys (index rows and this
    input's), at least one node from the input; kept in a pairs file for a resumed run."""
    p, pieces, done, run = item
    if done:
        return spill.load(run.file("pairs", p))
    rows = spill.read_pieces(pieces, _ROW)
    rows = rows[np.lexsort((rows["node"], rows["col"], rows["key"]))]  # pieces are each sorted
    pairs = _pairs_in_buckets(rows)
    pairs = _distinct(pairs[pairs[:, 1] >= run.m])  # two index docs were both kept already
    spill.save(run.file("pairs", p), pairs)
    return pairs


def _index_shard_task(item: tuple[int, list[spill.Piece], np.ndarray, _Run]) -> str:
    """The new index's rows of one key range: the old index's and those of this input's documents
    it keeps (renumbered after the old index, in input order; `excluded`: the input positions it
    does not keep, ascending). Returns the file it wrote."""
    p, pieces, excluded, run = item
    rows = spill.read_pieces(pieces, _ROW)
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


def _components(n_nodes: int, pairs: np.ndarray) -> np.ndarray:
    """Union-find over all edges at once: each node's root is the smallest node of its component.
    Roots hook onto the smaller root across every edge, then pointers jump to their roots."""
    parent = np.arange(n_nodes)
    while True:
        ra, rb = parent[pairs[:, 0]], parent[pairs[:, 1]]
        differ = ra != rb
        if not differ.any():
            return parent
        np.minimum.at(parent, np.maximum(ra, rb)[differ], np.minimum(ra, rb)[differ])
        while not np.array_equal(parent[parent], parent):
            parent = parent[parent]


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


@dataclass(frozen=True, kw_only=True)
class DedupResult:
    """The input documents removed as near-duplicates, each with its survivor (a document of this
    input or of the index), and the clusters: per cluster member only, so nothing here grows with
    the documents that have no near-duplicate."""

    n: int  # input documents
    removed: np.ndarray  # int64 [r]: positions of the removed input documents, ascending
    survivor: list[str]  # [r]: the id of each removed document's survivor
    members: np.ndarray  # int64 [c]: positions of the input documents in a cluster, ascending
    member_cluster: np.ndarray  # int64 [c]: their clusters, numbered by smallest member, index first
    index: DedupIndex | None  # the given index plus this input's kept documents, when saved
    candidate_pairs: int  # distinct pairs sharing a bucket (index-only pairs excluded)
    verified_pairs: int  # candidate pairs with Jaccard >= threshold
    clusters: int  # clusters with 2+ members, at least one from this input
    largest_cluster: int  # members of the largest of them (index documents included); 0: none
    removed_by_index: int  # removed documents whose survivor is in the index

    @property
    def near_duplicates(self) -> int:
        return len(self.removed)

    @property
    def keep(self) -> np.ndarray:
        keep = np.ones(self.n, bool)
        keep[self.removed] = False
        return keep

    @property
    def cluster(self) -> np.ndarray:
        """int64 [n]: each input document's cluster, -1 for none."""
        cluster = np.full(self.n, -1, np.int64)
        cluster[self.members] = self.member_cluster
        return cluster

    @property
    def representative(self) -> list[str | None]:
        """[n]: each removed document's survivor, None for a kept one."""
        out: list[str | None] = [None] * self.n
        for i, name in zip(self.removed.tolist(), self.survivor):
            out[i] = name
        return out

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in ("near_duplicates", "clusters", "largest_cluster",
                                                       "candidate_pairs", "verified_pairs",
                                                       "removed_by_index")}


def _exact_task(item: tuple[Sequence[str], np.ndarray, DedupConfig]) -> np.ndarray:
    """Which pairs [k, 2] of positions in `texts` have exact Jaccard >= threshold (bool [k])."""
    texts, pairs, cfg = item
    return exact_jaccards(*shingle_sets(texts, cfg), pairs) >= cfg.threshold - 1e-9


def exact_verify(pairs: np.ndarray, texts: Sequence[str], cfg: DedupConfig, engine: Engine) -> np.ndarray:
    """The pairs [k, 2] of positions in `texts` whose exact Jaccard similarity of shingle sets
    is >= threshold, checked in blocks through `engine.map` (workers read their texts)."""
    blocks = [pairs[lo:lo + _EXACT_PAIRS_PER_BLOCK] for lo in range(0, len(pairs), _EXACT_PAIRS_PER_BLOCK)]
    items = []
    for block in blocks:
        docs, local = np.unique(block, return_inverse=True)
        items.append((take(texts, docs), local.reshape(-1, 2), cfg))
    similar = engine.map(_exact_task, items)
    return np.concatenate([np.zeros((0, 2), np.int64)] + [b[s] for b, s in zip(blocks, similar)])


def _index_verify(pairs: np.ndarray, index: DedupIndex, run: _Run) -> np.ndarray:
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


def _partition_bits(docs: int, cfg: DedupConfig) -> int:
    """Enough partitions of the bucket keys that each holds about `partition_mb` of rows."""
    return spill.partition_bits(docs * cfg.bands * cfg.band_layouts * _ROW.itemsize, cfg.partition_mb)


def _run_dir(work_dir: str, cfg: DedupConfig, index: DedupIndex | None, ids: Sequence[str]) -> str:
    """A folder under `work_dir` named by what the run computes (the settings, the index and
    the document ids), so files of an earlier attempt are reused only by the same run."""
    digest = hashlib.sha256(json.dumps([cfg.model_dump(), str(index.directory) if index else None,
                                        len(index) if index else 0]).encode())
    for lo in range(0, len(ids), _BLOCK_ROWS):
        digest.update("\n".join(ids[lo:lo + _BLOCK_ROWS]).encode())
    return f"{work_dir}/run-{digest.hexdigest()[:16]}"


def _write_index(run: _Run, index: DedupIndex | None, ids: Sequence[str], excluded: np.ndarray,
                 parts: list[list[spill.Piece]], engine: Engine, index_dir: Path) -> DedupIndex:
    """The old index plus the input documents not `excluded`, in `index_dir` (index.json last):
    ids and signatures copied a block at a time, the bucket shards written on the engine."""
    index_dir.mkdir(parents=True, exist_ok=True)
    m, n, cfg = run.m, len(ids), run.cfg
    kept = np.ones(n, bool)
    kept[excluded] = False
    total = m + int(kept.sum())
    width = max([1, index.ids.dtype.itemsize // 4 if index else 1]
                + [max(map(len, ids[lo:lo + _BLOCK_ROWS])) for lo in range(0, n, _BLOCK_ROWS)])

    def old_rows(array: np.ndarray) -> Iterator[np.ndarray]:
        return (array[lo:lo + _BLOCK_ROWS] for lo in range(0, m, _BLOCK_ROWS))

    chunks = list(enumerate(range(0, n, cfg.chunk_docs)))
    new_ids = ([ids[start + i] for i in np.flatnonzero(kept[start:start + cfg.chunk_docs]).tolist()]
               for _, start in chunks)
    new_sigs = (spill.load(run.file("sig", c))[kept[start:start + cfg.chunk_docs]] for c, start in chunks)
    spill.write_npy(index_dir / "ids.npy", np.dtype(f"<U{width}"), (total,),
               itertools.chain(old_rows(index.ids) if index else (), new_ids))
    spill.write_npy(index_dir / "signatures.npy", np.dtype(np.uint32), (total, cfg.num_perm),
               itertools.chain(old_rows(index.signatures) if index else (), new_sigs))
    shards = engine.map(_index_shard_task, [(p, pieces, excluded, run) for p, pieces in enumerate(parts)])
    for p, shard in enumerate(shards):
        fetch_file(shard, index_dir / f"buckets-{p:06d}.npy")
    meta = {"format": INDEX_FORMAT, "docs": total, "bits": run.bits,
            **{name: getattr(cfg, name) for name in _INDEX_FIELDS}}
    (index_dir / "index.json").write_text(json.dumps(meta, indent=2) + "\n")
    return DedupIndex.load(index_dir)


def near_dedup(texts: Sequence[str], cfg: DedupConfig, engine: Engine,
               index: DedupIndex | None = None, *, ids: Sequence[str] | None = None,
               work_dir: str | Path | None = None, index_dir: Path | None = None) -> DedupResult:
    """Near-duplicate clusters of `texts` (and against `index`); one survivor per cluster.

    `ids` name the documents in the new index and the survivors (default: input positions as
    strings; pass stable ids when the index is saved and chained). `work_dir` (a path or URL the
    engine's workers reach) keeps the spilled signatures, bucket rows and candidate pairs, so a
    run killed part way reuses what it finished (default: a temporary folder). `index_dir`: where
    the new index is written (None: not written)."""
    if index is not None:
        index.check_compatible(cfg)
    ids = [str(i) for i in range(len(texts))] if ids is None else ids
    if len(ids) != len(texts):
        raise ValueError(f"ids: {len(ids)} ids for {len(texts)} texts")
    m, n = len(index) if index is not None else 0, len(texts)
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="near-dedup-"))
        run = _Run(work_dir=_run_dir(str(work_dir), cfg, index, ids), cfg=cfg,
                   bits=_partition_bits(m + n, cfg), m=m)
        done = names_in(run.work_dir, create=True)
        chunks = [(texts[s:s + cfg.chunk_docs], c, s, f"sig-{c:06d}.npy" in done, run)
                  for c, s in enumerate(range(0, n, cfg.chunk_docs))]
        mapped = engine.map(_chunk_task, chunks)
        del chunks
        active = np.concatenate([np.ones(0, bool)] + [a for a, _ in mapped])
        parts = index.pieces(run.bits) if index is not None else [[] for _ in range(1 << run.bits)]
        for c, (_, bounds) in enumerate(mapped):
            spill.add_pieces(parts, run.file("rows", c), bounds)
        del mapped
        pairs = engine.map(_partition_task, [(p, pieces, f"pairs-{p:06d}.npy" in done, run)
                                             for p, pieces in enumerate(parts)])
        candidates = _distinct(np.concatenate([np.zeros((0, 2), np.int64), *pairs]))
        del pairs
        in_index = candidates[:, 0] < m
        verified = np.concatenate([_index_verify(candidates[in_index], index, run) if index is not None and m else
                                   np.zeros((0, 2), np.int64),
                                   exact_verify(candidates[~in_index] - m, texts, cfg, engine) + m])
        # components over the nodes of verified pairs only
        nodes, local = np.unique(verified.ravel(), return_inverse=True)
        roots = nodes[_components(len(nodes), local.reshape(-1, 2))]
        sizes = np.bincount(np.searchsorted(nodes, roots), minlength=len(nodes))
        cluster_roots = np.unique(roots)
        is_input = nodes >= m
        removed_at = is_input & (roots != nodes)
        removed, survivors = nodes[removed_at] - m, roots[removed_at]
        survivor = [str(index.ids[r]) if index is not None and r < m else str(ids[r - m]) for r in survivors.tolist()]
        excluded = np.union1d(removed, np.flatnonzero(~active))  # words-less: nothing to match later
        new_index = _write_index(run, index, ids, excluded, parts, engine, Path(index_dir)) \
            if index_dir is not None else None
    return DedupResult(
        n=n, removed=removed, survivor=survivor, members=nodes[is_input] - m,
        member_cluster=np.searchsorted(cluster_roots, roots[is_input]), index=new_index,
        candidate_pairs=len(candidates), verified_pairs=len(verified), clusters=len(cluster_roots),
        largest_cluster=int(sizes.max()) if len(nodes) else 0,
        removed_by_index=int((survivors < m).sum()))
