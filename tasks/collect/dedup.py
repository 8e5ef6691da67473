"""Near-duplicate detection for the collect stage: MinHash signatures, LSH banding, clusters.

    result = near_dedup(texts, DedupConfig(), engine, index=DedupIndex.load(old_dir), ids=doc_ids)
    kept = [t for t, k in zip(texts, result.keep) if k]
    result.index.save(new_dir)       # the next refresh dedups against everything kept so far

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
Signatures are computed through `engine.map` over fixed-size chunks of documents, bucketing
over fixed-size groups of bands and the exact check over fixed-size blocks of candidate pairs;
the merge is order-free, so the result is the same for any engine, worker count or completion
order.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.stage import Engine
from tasks.collect.minhash import (
    EMPTY_SIG,
    chunk_signatures,
    exact_jaccards,
    shingle_sets,
)
from tasks.collect.spool import take

INDEX_FORMAT = 2  # 2: band keys of every band layout (format 1 had layout 0 only)
_U64 = np.uint64
_PAIRS_PER_BLOCK = 65_536  # candidate pairs verified at once against the index's signatures
# pairs of input documents checked exactly at once: both shingle sets of each (~300 8-byte
# hashes for a 300-word page) are sorted together, so a block holds ~40 MB per temporary
_EXACT_PAIRS_PER_BLOCK = 8_192
_PAIRED_PER_BUCKET = 8  # a bucket's node is paired with at most this many earlier nodes
_CHUNKS_PER_MAP = 64  # signature chunks mapped at once (at least 4 a worker): ~47 MB of results


class DedupConfig(BaseModel):
    """How documents are shingled, hashed and judged near-duplicate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shingle_words: int = Field(5, ge=1, description="Words per shingle (word n-gram size).")
    # A pair of Jaccard similarity s shares a bucket in at least one band of one layout with
    # probability about 1 - (1 - s**rows)**(bands * band_layouts) (the second layout's bands
    # share one value with each of `rows` first-layout bands, so they are nearly independent):
    # for 18 x 6 and two layouts 0.43 at s=0.5, 0.82 at 0.6, 0.99 at 0.7 (one layout: 0.25,
    # 0.58, 0.90). The exact-Jaccard check then decides, so more candidates cost time, never
    # precision. Measured on bench/neardup_set.py (seeds 0-3, 1,976-2,011 docs; see the README),
    # precision 1.0 everywhere; recall 0.95-0.96 with one layout checked at 0.6, 0.97-0.98 with
    # two, 0.98-0.99 with two checked at 0.55 (datatrove at 18 x 6, no check: 0.955-0.972).
    # Below 0.55 the labelled set gains little and real pages sharing only a site's navigation
    # (0.49 in that set) come close.
    bands: int = Field(18, ge=1, description="LSH bands; bands x rows = hash permutations.")
    rows: int = Field(6, ge=1, description="Signature values per band (all must match for two "
                                           "documents to share the band's bucket).")
    band_layouts: int = Field(2, ge=1, le=2, description="Ways the signature is cut into bands "
                                                         "(1: consecutive values; 2: also one "
                                                         "value of each of `rows` bands).")
    threshold: float = Field(0.55, gt=0, le=1, description="Jaccard similarity of shingle sets "
                                                            "at or above which two documents are "
                                                            "near-duplicates (exact for two input "
                                                            "documents, estimated from the "
                                                            "signatures against the index).")
    seed: int = Field(1, ge=0, description="Seed of the hash permutations. Signatures (and a "
                                           "persisted index) are comparable only under one seed.")
    chunk_docs: int = Field(1024, ge=1, description="Documents per signature task (independent "
                                                    "of the worker count; results do not change).")
    bands_per_task: int = Field(4, ge=1, description="Bands bucketed per task (results do not "
                                                     "change).")

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


_INDEX_FIELDS = ("shingle_words", "bands", "rows", "band_layouts", "seed")  # signature settings


def _bucket_task(item: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Candidate pairs [k, 2] (smaller node first) from bucket keys [n, bands in the group] of
    `nodes` (ascending ids): in each bucket, every node paired with each of the first
    _PAIRED_PER_BUCKET nodes before it. All pairs of a small bucket, so a near-duplicate is not
    lost because the bucket's first node fails the Jaccard check with it; a bound for the huge
    buckets that boilerplate makes."""
    keys, nodes = item
    pairs = [np.zeros((0, 2), np.int64)]
    for col in keys.T if len(nodes) else ():
        order = np.argsort(col, kind="stable")  # stable: equal keys stay in node order
        sorted_keys = col[order]
        head = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        group_start = np.repeat(head, np.diff(np.r_[head, len(col)]))
        n_earlier = np.minimum(np.arange(len(col)) - group_start, _PAIRED_PER_BUCKET)
        right = np.repeat(np.arange(len(col)), n_earlier)
        left = np.repeat(group_start, n_earlier) + (
            np.arange(len(right)) - np.repeat(np.cumsum(n_earlier) - n_earlier, n_earlier))
        pairs.append(np.stack([nodes[order[left]], nodes[order[right]]], axis=1))
    return np.concatenate(pairs)


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
class DedupIndex:
    """Signatures and bucket keys of every document kept so far, persisted as numpy files."""

    shingle_words: int
    bands: int
    rows: int
    band_layouts: int
    seed: int
    ids: np.ndarray  # str [m]
    signatures: np.ndarray  # uint32 [m, bands*rows]
    band_keys: np.ndarray  # uint64 [m, bands*band_layouts]

    FILES = ("ids.npy", "signatures.npy", "band_keys.npy")

    @classmethod
    def empty(cls, cfg: DedupConfig) -> DedupIndex:
        return cls(shingle_words=cfg.shingle_words, bands=cfg.bands, rows=cfg.rows,
                   band_layouts=cfg.band_layouts, seed=cfg.seed,
                   ids=np.zeros(0, "<U1"), signatures=np.zeros((0, cfg.num_perm), np.uint32),
                   band_keys=np.zeros((0, cfg.bands * cfg.band_layouts), _U64))

    def __len__(self) -> int:
        return len(self.ids)

    def check_compatible(self, cfg: DedupConfig) -> None:
        """ValueError naming the first config field the stored signatures disagree with."""
        for name in _INDEX_FIELDS:
            if getattr(self, name) != getattr(cfg, name):
                raise ValueError(f"{name}: the index was built with {getattr(self, name)}, the "
                                 f"config says {getattr(cfg, name)}; rebuild the index")

    def extend(self, ids: Sequence[str], signatures: np.ndarray,
               keys: np.ndarray) -> DedupIndex:
        """A new index holding these documents after the current ones (the arrays themselves when
        the current index is empty: no copy of the corpus's signatures)."""
        ids_arr = np.asarray(list(ids), dtype=str)

        def after(old: np.ndarray, new: np.ndarray) -> np.ndarray:
            return new if len(old) == 0 else np.concatenate([old, new])

        return DedupIndex(shingle_words=self.shingle_words, bands=self.bands, rows=self.rows,
                          band_layouts=self.band_layouts, seed=self.seed, ids=after(self.ids, ids_arr),
                          signatures=after(self.signatures, signatures.astype(np.uint32, copy=False)),
                          band_keys=after(self.band_keys, keys.astype(_U64, copy=False)))

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, array in zip(self.FILES, (self.ids, self.signatures, self.band_keys)):
            np.save(directory / name, array, allow_pickle=False)
        meta = {"format": INDEX_FORMAT, "docs": len(self),
                **{name: getattr(self, name) for name in _INDEX_FIELDS}}
        (directory / "index.json").write_text(json.dumps(meta, indent=2) + "\n")  # written last

    @classmethod
    def load(cls, directory: Path) -> DedupIndex:
        directory = Path(directory)
        meta_path = directory / "index.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path}: no dedup index here (index.json is missing)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != INDEX_FORMAT:
            raise ValueError(f"{meta_path}: index format {meta.get('format')}, this version reads "
                             f"format {INDEX_FORMAT} only; rebuild the index (rerun the collect "
                             f"stage that wrote it)")
        arrays = [np.load(directory / name, allow_pickle=False) for name in cls.FILES]
        ids, signatures, band_keys = arrays
        index = cls(**{name: meta[name] for name in _INDEX_FIELDS},
                    ids=ids, signatures=signatures, band_keys=band_keys)
        shapes = {"ids.npy": (meta["docs"],),
                  "signatures.npy": (meta["docs"], meta["bands"] * meta["rows"]),
                  "band_keys.npy": (meta["docs"], meta["bands"] * meta["band_layouts"])}
        for name, array in zip(cls.FILES, arrays):
            if array.shape != shapes[name]:
                raise ValueError(f"{directory / name}: shape {array.shape}, index.json implies "
                                 f"{shapes[name]}")
        return index


@dataclass(frozen=True, kw_only=True)
class DedupResult:
    """Per input document: keep flag, cluster id (-1: no near-duplicate) and, for removed
    documents, the id of the survivor (a document of this input or of the index)."""

    keep: np.ndarray  # bool [n]
    cluster: np.ndarray  # int64 [n]; clusters numbered by their smallest member, index first
    representative: list[str | None]
    index: DedupIndex  # the given index plus this input's kept documents
    candidate_pairs: int  # distinct pairs sharing a bucket (index-only pairs excluded)
    verified_pairs: int  # candidate pairs with Jaccard >= threshold
    near_duplicates: int  # documents removed
    clusters: int  # clusters with 2+ members, at least one from this input
    largest_cluster: int  # members of the largest of them (index documents included); 0: none
    removed_by_index: int  # removed documents whose survivor is in the index

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in ("near_duplicates", "clusters", "largest_cluster",
                                                       "candidate_pairs", "verified_pairs",
                                                       "removed_by_index")}


def _candidate_pairs(index: DedupIndex, keys: np.ndarray, active: np.ndarray,
                     cfg: DedupConfig, engine: Engine) -> np.ndarray:
    """Distinct candidate pairs over nodes (index docs 0..m-1, then this input's docs)."""
    m = len(index)
    nodes = np.r_[np.arange(m), m + np.flatnonzero(active)]
    # a copy only where there is something to join or leave out
    all_keys = keys if m == 0 and active.all() else np.concatenate([index.band_keys, keys[active]])
    groups = [(all_keys[:, g:g + cfg.bands_per_task], nodes)
              for g in range(0, all_keys.shape[1], cfg.bands_per_task)]
    pairs = np.concatenate([np.zeros((0, 2), np.int64), *engine.map(_bucket_task, groups)])
    pairs = pairs[pairs[:, 1] >= m]  # two index docs were both kept already
    codes = np.unique(pairs[:, 0].astype(np.int64) * (m + len(keys)) + pairs[:, 1])
    return np.stack(np.divmod(codes, m + len(keys)), axis=1)


def _exact_task(item: tuple[Sequence[str], np.ndarray, DedupConfig]) -> np.ndarray:
    """Which pairs [k, 2] of positions in `texts` have exact Jaccard >= threshold (bool [k])."""
    texts, pairs, cfg = item
    return exact_jaccards(*shingle_sets(texts, cfg), pairs) >= cfg.threshold - 1e-9


def _verify(pairs: np.ndarray, index: DedupIndex, sigs: np.ndarray, texts: Sequence[str],
            cfg: DedupConfig, engine: Engine) -> np.ndarray:
    """Pairs whose Jaccard similarity is >= threshold: exact over shingle sets for two input
    documents (blocks of pairs through `engine.map`), the fraction of equal signature values
    against an index document."""
    m = len(index)
    in_index = pairs[:, 0] < m  # the second node of a pair is always from this input
    outer, inner = pairs[in_index], pairs[~in_index]
    min_equal = math.ceil(cfg.threshold * cfg.num_perm - 1e-9)
    kept = [np.zeros((0, 2), np.int64)]
    for lo in range(0, len(outer), _PAIRS_PER_BLOCK):
        block = outer[lo:lo + _PAIRS_PER_BLOCK]
        equal = (index.signatures[block[:, 0]] == sigs[block[:, 1] - m]).sum(axis=1)
        kept.append(block[equal >= min_equal])
    blocks = [inner[lo:lo + _EXACT_PAIRS_PER_BLOCK]
              for lo in range(0, len(inner), _EXACT_PAIRS_PER_BLOCK)]
    items = []
    for block in blocks:
        docs, local = np.unique(block - m, return_inverse=True)
        items.append((take(texts, docs), local.reshape(-1, 2), cfg))
    kept += [block[similar] for block, similar in zip(blocks, engine.map(_exact_task, items))]
    return np.concatenate(kept)


def _signatures(texts: Sequence[str], cfg: DedupConfig,
                engine: Engine) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Signatures and bucket keys of every document, computed in chunks through `engine.map`, and
    which documents have words (a real signature holds 108 values of 2**32, not all the maximum).
    The chunks are mapped a batch at a time and copied into two arrays, so the corpus's signatures
    are held once, not twice: a batch is enough chunks to keep every worker busy."""
    n = len(texts)
    sigs = np.empty((n, cfg.num_perm), np.uint32)
    keys = np.empty((n, cfg.bands * cfg.band_layouts), _U64)
    active = np.empty(n, bool)
    starts = range(0, n, cfg.chunk_docs)
    per_map = max(_CHUNKS_PER_MAP, 4 * getattr(engine, "num_workers", 1))
    for lo in range(0, len(starts), per_map):
        batch = starts[lo:lo + per_map]
        chunks = [(texts[s:s + cfg.chunk_docs], cfg) for s in batch]  # spooled: lazy, read by the worker
        for start, (chunk_sigs, chunk_keys) in zip(batch, engine.map(chunk_signatures, chunks)):
            stop = start + len(chunk_sigs)
            sigs[start:stop], keys[start:stop] = chunk_sigs, chunk_keys
            active[start:stop] = ~(chunk_sigs == EMPTY_SIG).all(axis=1)
    return sigs, keys, active


def _compact(array: np.ndarray, rows: np.ndarray, block: int = 8_192) -> np.ndarray:
    """array[rows] for ascending `rows`, written over the array's own first rows (a block at a
    time: row j moves to j or earlier, never onto a row still to be read) instead of a copy."""
    for lo in range(0, len(rows), block):
        taken = rows[lo:lo + block]
        array[lo:lo + len(taken)] = array[taken]
    return array[:len(rows)]


def near_dedup(texts: Sequence[str], cfg: DedupConfig, engine: Engine,
               index: DedupIndex | None = None, *, ids: Sequence[str] | None = None) -> DedupResult:
    """Near-duplicate clusters of `texts` (and against `index`); one survivor per cluster.

    `ids` name the documents in the returned index and in `representative` (default: input
    positions as strings; pass stable ids when the index is saved and chained)."""
    index = DedupIndex.empty(cfg) if index is None else index
    index.check_compatible(cfg)
    ids = [str(i) for i in range(len(texts))] if ids is None else list(ids)
    if len(ids) != len(texts):
        raise ValueError(f"ids: {len(ids)} ids for {len(texts)} texts")
    sigs, keys, active = _signatures(texts, cfg, engine)
    m, n = len(index), len(texts)
    candidates = _candidate_pairs(index, keys, active, cfg, engine)
    verified = _verify(candidates, index, sigs, texts, cfg, engine)
    roots = _components(m + n, verified)
    root = roots[m:]
    keep = root == np.arange(m, m + n)
    sizes = np.bincount(roots, minlength=m + n)
    in_cluster = sizes[root] >= 2
    cluster_roots = np.unique(root[in_cluster])
    cluster = np.full(n, -1, np.int64)
    cluster[in_cluster] = np.searchsorted(cluster_roots, root[in_cluster])
    representative: list[str | None] = [None] * n
    for i in np.flatnonzero(~keep):  # the removed documents' survivors, by name
        r = int(root[i])
        representative[i] = str(index.ids[r]) if r < m else ids[r - m]
    kept = np.flatnonzero(keep & active)  # documents without words have nothing to match later
    return DedupResult(
        keep=keep, cluster=cluster, representative=representative,
        index=index.extend([ids[i] for i in kept], _compact(sigs, kept), _compact(keys, kept)),
        candidate_pairs=len(candidates), verified_pairs=len(verified),
        near_duplicates=int((~keep).sum()), clusters=len(cluster_roots),
        largest_cluster=int(sizes[cluster_roots].max()) if len(cluster_roots) else 0,
        removed_by_index=int((~keep & (root < m)).sum()))
