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

The settings and a run's spilled-file layout are config.py's; the persisted index (reading it,
checking a pair against it, writing the next one) is index.py's.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gristmill.core.clock import NO_CLOCK, StepClock
from gristmill.core.files import names_in
from gristmill.core.stage import Engine
from gristmill.tasks.collect.dedup.config import ROW, DedupConfig, Run
from gristmill.tasks.collect.dedup.index import BLOCK_ROWS, DedupIndex, index_verify, write_index
from gristmill.tasks.collect.dedup.minhash import (
    EMPTY_SIG,
    chunk_signatures,
    exact_jaccards,
    shingle_sets,
)
from gristmill.tasks.collect.output import spill
from gristmill.tasks.collect.read.texts import take

# pairs of input documents checked exactly at once, a task each: both shingle sets of each (~300
# 8-byte hashes for a 300-word page) are sorted together, so a block holds ~10 MB per temporary;
# small enough that a corpus's few blocks still keep every worker busy to the end
_EXACT_PAIRS_PER_BLOCK = 2_048
_PAIRED_PER_BUCKET = 8  # a bucket's node is paired with at most this many earlier nodes


def _bucket_rows(keys: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Bucket rows of documents' keys [n, columns], sorted by key (then column, then node)."""
    rows = np.empty(keys.size, ROW)
    rows["key"] = keys.ravel()
    rows["col"] = np.tile(np.arange(keys.shape[1], dtype=np.uint16), len(keys))
    rows["node"] = np.repeat(nodes, keys.shape[1])
    return rows[np.lexsort((rows["node"], rows["col"], rows["key"]))]

def _chunk_task(item: tuple[Sequence[str], int, int, bool, Run]) -> tuple[np.ndarray, np.ndarray]:
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

def _partition_task(item: tuple[int, list[spill.Piece], bool, Run]) -> np.ndarray:
    """Distinct candidate pairs [k, 2] of one partition of the bucket keys (index rows and this
    input's), at least one node from the input; kept in a pairs file for a resumed run."""
    p, pieces, done, run = item
    if done:
        return spill.load(run.file("pairs", p))
    rows = spill.read_pieces(pieces, ROW)
    rows = rows[np.lexsort((rows["node"], rows["col"], rows["key"]))]  # pieces are each sorted
    pairs = _pairs_in_buckets(rows)
    pairs = _distinct(pairs[pairs[:, 1] >= run.m])  # two index docs were both kept already
    spill.save(run.file("pairs", p), pairs)
    return pairs

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

def _partition_bits(docs: int, cfg: DedupConfig) -> int:
    """Enough partitions of the bucket keys that each holds about `partition_mb` of rows."""
    return spill.partition_bits(docs * cfg.bands * cfg.band_layouts * ROW.itemsize, cfg.partition_mb)

def _run_dir(work_dir: str, cfg: DedupConfig, index: DedupIndex | None, ids: Sequence[str]) -> str:
    """A folder under `work_dir` named by what the run computes (the settings, the index and
    the document ids), so files of an earlier attempt are reused only by the same run."""
    digest = hashlib.sha256(json.dumps([cfg.model_dump(), str(index.directory) if index else None,
                                        len(index) if index else 0]).encode())
    for lo in range(0, len(ids), BLOCK_ROWS):
        digest.update("\n".join(ids[lo:lo + BLOCK_ROWS]).encode())
    return f"{work_dir}/run-{digest.hexdigest()[:16]}"

def near_dedup(texts: Sequence[str], cfg: DedupConfig, engine: Engine,
               index: DedupIndex | None = None, *, ids: Sequence[str] | None = None,
               work_dir: str | Path | None = None, index_dir: Path | None = None,
               clock: StepClock = NO_CLOCK) -> DedupResult:
    """Near-duplicate clusters of `texts` (and against `index`); one survivor per cluster.

    `ids` name the documents in the new index and the survivors (default: input positions as
    strings; pass stable ids when the index is saved and chained). `work_dir` (a path or URL the
    engine's workers reach) keeps the spilled signatures, bucket rows and candidate pairs, so a
    run killed part way reuses what it finished (default: a temporary folder). `index_dir`: where
    the new index is written (None: not written). `clock`: its lap "minhash_signatures" is the map
    that computes the signatures and bucket rows, "near_dedup" what comes before."""
    if index is not None:
        index.check_compatible(cfg)
    ids = [str(i) for i in range(len(texts))] if ids is None else ids
    if len(ids) != len(texts):
        raise ValueError(f"ids: {len(ids)} ids for {len(texts)} texts")
    m, n = len(index) if index is not None else 0, len(texts)
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="near-dedup-"))
        run = Run(work_dir=_run_dir(str(work_dir), cfg, index, ids), cfg=cfg,
                   bits=_partition_bits(m + n, cfg), m=m)
        done = names_in(run.work_dir, create=True)
        chunks = [(texts[s:s + cfg.chunk_docs], c, s, f"sig-{c:06d}.npy" in done, run)
                  for c, s in enumerate(range(0, n, cfg.chunk_docs))]
        clock.lap("near_dedup")
        mapped = engine.map(_chunk_task, chunks)
        clock.lap("minhash_signatures")
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
        verified = np.concatenate([index_verify(candidates[in_index], index, run) if index is not None and m else
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
        new_index = write_index(run, index, ids, excluded, parts, engine, Path(index_dir)) \
            if index_dir is not None else None
    return DedupResult(
        n=n, removed=removed, survivor=survivor, members=nodes[is_input] - m,
        member_cluster=np.searchsorted(cluster_roots, roots[is_input]), index=new_index,
        candidate_pairs=len(candidates), verified_pairs=len(verified), clusters=len(cluster_roots),
        largest_cluster=int(sizes.max()) if len(nodes) else 0,
        removed_by_index=int((survivors < m).sum()))
