"""Near-duplicate detection for the collect stage: MinHash signatures, LSH banding, clusters.

    result = near_dedup(texts, DedupConfig(), engine, index=DedupIndex.load(old_dir), ids=doc_ids)
    kept = [t for t, k in zip(texts, result.keep) if k]
    result.index.save(new_dir)       # the next refresh dedups against everything kept so far

Steps (each vectorized with numpy over a chunk of documents):
  1. normalize: lowercase, punctuation and symbols become spaces, whitespace collapses;
  2. shingle: every run of `shingle_words` consecutive words, hashed (deterministic 64-bit hashes,
     never Python's salted `hash()`);
  3. MinHash: `bands * rows` hash permutations, the minimum of each over a document's shingles;
  4. LSH: a band's `rows` values hash to a bucket key; documents sharing a key in any band are
     candidate pairs; a candidate pair counts as a near-duplicate only if the fraction of equal
     signature values (the estimated Jaccard similarity) is >= `threshold`;
  5. clusters: connected components of the verified pairs. Exactly one document per cluster
     survives: one already in the persisted index if the cluster holds one, else the earliest
     in input order.
Signatures are computed through `engine.map` over fixed-size chunks of documents, and bucketing
through `engine.map` over fixed-size groups of bands; the merge is order-free, so the result is the
same for any engine, worker count or completion order.
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

INDEX_FORMAT = 1
_U64 = np.uint64
_MASK64 = (1 << 64) - 1
_EMPTY_SIG = np.uint32(0xFFFFFFFF)  # signature value of a document with no words
_SHINGLES_PER_BLOCK = 8_192  # shingles per [permutations x shingles] uint64 block: 7 MB at 112
_PAIRS_PER_BLOCK = 65_536  # candidate pairs verified at once
_PAIRED_PER_BUCKET = 8  # a bucket's node is paired with at most this many earlier nodes


class DedupConfig(BaseModel):
    """How documents are shingled, hashed and judged near-duplicate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shingle_words: int = Field(5, ge=1, description="Words per shingle (word n-gram size).")
    # A pair of Jaccard similarity s shares a bucket in at least one band with probability
    # 1 - (1 - s**rows)**bands. 18 x 6 puts the middle of that S-curve at 0.62 (~ threshold):
    # 0.25 at s=0.5, 0.58 at 0.6, 0.90 at 0.7, 0.996 at 0.8. Measured on bench/neardup_set.py
    # (4 seeds, ~2200 docs each), checked at 0.6 it kept precision 1.0 at recall 0.94-0.97;
    # 14 x 8 (datatrove's default) with no check reached 0.85-0.91 there.
    bands: int = Field(18, ge=1, description="LSH bands; bands x rows = hash permutations.")
    rows: int = Field(6, ge=1, description="Signature values per band (all must match for two "
                                           "documents to share the band's bucket).")
    threshold: float = Field(0.6, gt=0, le=1, description="Jaccard similarity of shingle sets "
                                                            "at or above which two documents are "
                                                            "near-duplicates (estimated from the "
                                                            "signatures of each candidate pair).")
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


def _splitmix64(seed: int, n: int) -> np.ndarray:
    """n well-mixed 64-bit constants from `seed`; plain integer arithmetic, stable everywhere."""
    out, x = [], seed & _MASK64
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return np.array(out, dtype=_U64)


def _mix(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer: every input bit flips each output bit with probability ~1/2."""
    x = x ^ (x >> _U64(33))
    x *= _U64(0xFF51AFD7ED558CCD)
    x ^= x >> _U64(33)
    x *= _U64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> _U64(33))


# Bytes that belong to words: ASCII letters and digits, and every byte of a non-ASCII character
# (letters of other scripts) except the punctuation handled in _word_mask.
_WORD_BYTE = np.array([c >= 0x80 or chr(c).isalnum() for c in range(256)])
_POLY = 0x100000001B3  # FNV-1a's 64-bit prime; odd, so invertible modulo 2**64
_POLY_INV = pow(_POLY, -1, 1 << 64)


def _word_mask(buf: np.ndarray) -> np.ndarray:
    """Which bytes of lowercased UTF-8 are word characters; punctuation, symbols and whitespace
    are not. Besides ASCII, the General Punctuation block (U+2000-206F: curly quotes, dashes,
    ellipsis, bullets) and Latin-1 punctuation (U+00A0-00BF: no-break space, guillemets, (c))
    separate words; other scripts' punctuation stays attached to its word."""
    word = _WORD_BYTE[buf]
    lead = np.flatnonzero((buf[:-2] == 0xE2) & ((buf[1:-1] == 0x80) | (buf[1:-1] == 0x81)))
    for k in range(3):
        word[lead + k] = False
    lead = np.flatnonzero((buf[:-1] == 0xC2) & (buf[1:] >= 0xA0))
    word[lead] = word[lead + 1] = False
    return word


def normalize(text: str) -> str:
    """The words the hashes see: lowercased, punctuation removed, single spaces."""
    buf = np.frombuffer(text.lower().encode(), np.uint8)
    if buf.size == 0:
        return ""
    return " ".join(np.where(_word_mask(buf), buf, 32).astype(np.uint8).tobytes().decode().split())


def _word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(hash of every word of every text, in order; number of words per text).

    One polynomial hash per word over the bytes of the whole chunk: with prefix sums
    H[i] = sum_{j<i} b_j P^j (mod 2**64), word [s, e) hashes to (H[e] - H[s]) * P^-s, which depends
    only on the word's bytes, not on where the chunk put it. Its length is mixed in too."""
    encoded = [t.lower().encode() for t in texts]
    doc_starts = np.cumsum([0] + [len(b) for b in encoded])
    buf = np.frombuffer(b"".join(encoded), np.uint8)
    if buf.size == 0:
        return np.zeros(0, _U64), np.zeros(len(texts), np.int64)
    word = _word_mask(buf)
    boundary = np.zeros(buf.size + 1, bool)
    boundary[doc_starts] = True  # a word never runs from one text into the next
    starts = np.flatnonzero(word & (~np.r_[False, word[:-1]] | boundary[:-1]))
    ends = np.flatnonzero(word & (~np.r_[word[1:], False] | boundary[1:])) + 1
    powers = np.cumprod(np.r_[np.uint64(1), np.full(buf.size, _POLY, _U64)])  # P^i, wrapping
    inv_powers = np.cumprod(np.r_[np.uint64(1), np.full(buf.size - 1, _POLY_INV, _U64)])
    prefix = np.zeros(buf.size + 1, _U64)
    np.cumsum(buf * powers[:-1], out=prefix[1:])
    poly = (prefix[ends] - prefix[starts]) * inv_powers[starts]
    words_per_doc = np.bincount(np.searchsorted(doc_starts, starts, side="right") - 1,
                                minlength=len(texts))
    return _mix(poly ^ ((ends - starts).astype(_U64) << _U64(56))), words_per_doc


def _shingle_hashes(texts: Sequence[str], cfg: DedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """(hash of every shingle of every text, in order; shingles per text).

    A document of n >= k words has n - k + 1 shingles. A document shorter than one shingle
    (0 < n < k) still gets one: its n words, with the k - n missing positions hashed as 0, so two
    short documents match only if they hold the same words in the same order. A document with
    no words has no shingles (see `_signatures`)."""
    k = cfg.shingle_words
    words, n_words = _word_hashes(texts)
    nonempty = n_words > 0
    # k - 1 zero words after each document, so windows never mix two documents' words
    doc_index = np.repeat(np.arange(len(texts)), n_words)
    padded = np.zeros(words.size + (k - 1) * len(texts), _U64)
    padded[np.arange(words.size) + (k - 1) * doc_index] = words
    weights = _splitmix64(cfg.seed ^ 0x5EED, k) | _U64(1)
    n_starts = padded.size - k + 1
    combined = np.zeros(max(n_starts, 0), _U64)
    for j in range(k):
        combined += padded[j:j + n_starts] * weights[j]
    n_shingles = np.where(nonempty, np.maximum(n_words - k + 1, 1), 0)
    first = np.cumsum(np.r_[0, n_words[:-1] + k - 1])  # padded offset of each document
    offsets = np.cumsum(np.r_[0, n_shingles[:-1]])
    within = np.arange(n_shingles.sum()) - np.repeat(offsets, n_shingles)
    return _mix(combined[np.repeat(first, n_shingles) + within]), n_shingles


def _permutations(cfg: DedupConfig) -> tuple[np.ndarray, np.ndarray]:
    consts = _splitmix64(cfg.seed, 2 * cfg.num_perm)
    return consts[:cfg.num_perm] | _U64(1), consts[cfg.num_perm:]


def _signatures(texts: Sequence[str], cfg: DedupConfig) -> np.ndarray:
    """MinHash signatures, uint32 [n_docs, bands*rows].

    Permutation p maps a shingle hash x to the high 32 bits of (a_p x + b_p) mod 2**64
    (multiply-add-shift hashing); the high half of the minimum 64-bit value is the minimum of the
    high halves, so the shift happens once per document, after the minimum. Blocks are laid out
    [permutation, shingle] so each document's minimum is a reduction over a contiguous run.
    Documents with no words get _EMPTY_SIG in every position and never become candidates."""
    shingles, n_shingles = _shingle_hashes(texts, cfg)
    a, b = _permutations(cfg)
    sigs = np.full((len(texts), cfg.num_perm), _EMPTY_SIG, np.uint32)
    docs = np.flatnonzero(n_shingles)
    ends = np.cumsum(n_shingles[docs])
    buf = np.empty(cfg.num_perm * max(_SHINGLES_PER_BLOCK, int(n_shingles.max(initial=0))), _U64)
    lo = 0
    while lo < docs.size:  # blocks of whole documents, at most _SHINGLES_PER_BLOCK shingles
        start = ends[lo - 1] if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, start + _SHINGLES_PER_BLOCK, side="right")))
        block = buf[:cfg.num_perm * (ends[hi - 1] - start)].reshape(cfg.num_perm, -1)
        np.multiply(a[:, None], shingles[start:ends[hi - 1]], out=block)
        block += b[:, None]
        mins = np.minimum.reduceat(block, np.r_[0, ends[lo:hi - 1] - start], axis=1)
        sigs[docs[lo:hi]] = (mins >> _U64(32)).T
        lo = hi
    return sigs


def minhash_signatures(texts: Sequence[str], cfg: DedupConfig) -> np.ndarray:
    """MinHash signatures of `texts`, uint32 [n_docs, bands*rows]; identical however the texts
    are chunked."""
    return _signatures(list(texts), cfg)


def band_keys(signatures: np.ndarray, cfg: DedupConfig) -> np.ndarray:
    """Bucket key of each band of each signature, uint64 [n_docs, bands]."""
    rows = signatures.reshape(len(signatures), cfg.bands, cfg.rows).astype(_U64)
    keys = np.broadcast_to(_splitmix64(cfg.seed ^ 0xBA4D, cfg.bands), rows.shape[:2]).copy()
    for j in range(cfg.rows):
        keys = _mix(keys ^ rows[:, :, j])
    return keys


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Fraction of equal signature positions: the MinHash estimate of the Jaccard similarity."""
    return float(np.mean(sig_a == sig_b))


def shingle_set(text: str, cfg: DedupConfig) -> np.ndarray:
    """The distinct shingle hashes of one text, for exact Jaccard similarity."""
    return np.unique(_shingle_hashes([text], cfg)[0])


def exact_jaccard(a: str, b: str, cfg: DedupConfig) -> float:
    """|A & B| / |A | B| of the two texts' shingle sets (1.0 for two texts without words)."""
    sa, sb = shingle_set(a, cfg), shingle_set(b, cfg)
    union = np.union1d(sa, sb).size
    return np.intersect1d(sa, sb).size / union if union else 1.0


def _chunk_task(item: tuple[list[str], DedupConfig]) -> tuple[np.ndarray, np.ndarray]:
    """(signatures, bucket keys) of one chunk of documents."""
    texts, cfg = item
    sigs = _signatures(texts, cfg)
    return sigs, band_keys(sigs, cfg)


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


@dataclass(frozen=True)
class DedupIndex:
    """Signatures and bucket keys of every document kept so far, persisted as numpy files."""

    shingle_words: int
    bands: int
    rows: int
    seed: int
    ids: np.ndarray  # str [m]
    signatures: np.ndarray  # uint32 [m, bands*rows]
    band_keys: np.ndarray  # uint64 [m, bands]

    FILES = ("ids.npy", "signatures.npy", "band_keys.npy")

    @classmethod
    def empty(cls, cfg: DedupConfig) -> DedupIndex:
        return cls(cfg.shingle_words, cfg.bands, cfg.rows, cfg.seed, np.zeros(0, "<U1"),
                   np.zeros((0, cfg.num_perm), np.uint32), np.zeros((0, cfg.bands), _U64))

    def __len__(self) -> int:
        return len(self.ids)

    def check_compatible(self, cfg: DedupConfig) -> None:
        """ValueError naming the first config field the stored signatures disagree with."""
        for name in ("shingle_words", "bands", "rows", "seed"):
            if getattr(self, name) != getattr(cfg, name):
                raise ValueError(f"{name}: the index was built with {getattr(self, name)}, the "
                                 f"config says {getattr(cfg, name)}; rebuild the index")

    def extend(self, ids: Sequence[str], signatures: np.ndarray,
               keys: np.ndarray) -> DedupIndex:
        """A new index holding these documents after the current ones."""
        ids_arr = np.asarray(list(ids), dtype=str)
        return DedupIndex(self.shingle_words, self.bands, self.rows, self.seed,
                          np.concatenate([self.ids, ids_arr]),
                          np.concatenate([self.signatures, signatures.astype(np.uint32)]),
                          np.concatenate([self.band_keys, keys.astype(_U64)]))

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, array in zip(self.FILES, (self.ids, self.signatures, self.band_keys)):
            np.save(directory / name, array, allow_pickle=False)
        meta = {"format": INDEX_FORMAT, "docs": len(self), "shingle_words": self.shingle_words,
                "bands": self.bands, "rows": self.rows, "seed": self.seed}
        (directory / "index.json").write_text(json.dumps(meta, indent=2) + "\n")  # written last

    @classmethod
    def load(cls, directory: Path) -> DedupIndex:
        directory = Path(directory)
        meta_path = directory / "index.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path}: no dedup index here (index.json is missing)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != INDEX_FORMAT:
            raise ValueError(f"{meta_path}: format {meta.get('format')}, expected {INDEX_FORMAT}")
        arrays = [np.load(directory / name, allow_pickle=False) for name in cls.FILES]
        index = cls(meta["shingle_words"], meta["bands"], meta["rows"], meta["seed"], *arrays)
        shapes = {"ids.npy": (meta["docs"],),
                  "signatures.npy": (meta["docs"], meta["bands"] * meta["rows"]),
                  "band_keys.npy": (meta["docs"], meta["bands"])}
        for name, array in zip(cls.FILES, arrays):
            if array.shape != shapes[name]:
                raise ValueError(f"{directory / name}: shape {array.shape}, index.json implies "
                                 f"{shapes[name]}")
        return index


@dataclass(frozen=True)
class DedupResult:
    """Per input document: keep flag, cluster id (-1: no near-duplicate) and, for removed
    documents, the id of the survivor (a document of this input or of the index)."""

    keep: np.ndarray  # bool [n]
    cluster: np.ndarray  # int64 [n]; clusters numbered by their smallest member, index first
    representative: list[str | None]
    index: DedupIndex  # the given index plus this input's kept documents
    candidate_pairs: int  # distinct pairs sharing a bucket (index-only pairs excluded)
    verified_pairs: int  # candidate pairs with estimated Jaccard >= threshold
    near_duplicates: int  # documents removed
    clusters: int  # clusters with 2+ members, at least one from this input
    removed_by_index: int  # removed documents whose survivor is in the index

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in ("near_duplicates", "clusters",
                                                       "candidate_pairs", "verified_pairs",
                                                       "removed_by_index")}


def _candidate_pairs(index: DedupIndex, keys: np.ndarray, active: np.ndarray,
                     cfg: DedupConfig, engine: Engine) -> np.ndarray:
    """Distinct candidate pairs over nodes (index docs 0..m-1, then this input's docs)."""
    m = len(index)
    nodes = np.r_[np.arange(m), m + np.flatnonzero(active)]
    all_keys = np.concatenate([index.band_keys, keys[active]])
    groups = [(all_keys[:, g:g + cfg.bands_per_task], nodes)
              for g in range(0, cfg.bands, cfg.bands_per_task)]
    pairs = np.concatenate([np.zeros((0, 2), np.int64), *engine.map(_bucket_task, groups)])
    pairs = pairs[pairs[:, 1] >= m]  # two index docs were both kept already
    codes = np.unique(pairs[:, 0].astype(np.int64) * (m + len(keys)) + pairs[:, 1])
    return np.stack(np.divmod(codes, m + len(keys)), axis=1)


def _verify(pairs: np.ndarray, index: DedupIndex, sigs: np.ndarray,
            cfg: DedupConfig) -> np.ndarray:
    """Pairs whose signatures agree in at least threshold * bands*rows positions."""
    m = len(index)
    min_equal = math.ceil(cfg.threshold * cfg.num_perm - 1e-9)
    kept = []
    for lo in range(0, len(pairs), _PAIRS_PER_BLOCK):
        block = pairs[lo:lo + _PAIRS_PER_BLOCK]
        in_index = block[:, 0] < m  # the second node of a pair is always from this input
        left = np.empty((len(block), cfg.num_perm), np.uint32)
        left[in_index] = index.signatures[block[in_index, 0]]
        left[~in_index] = sigs[block[~in_index, 0] - m]
        equal = (left == sigs[block[:, 1] - m]).sum(axis=1)
        kept.append(block[equal >= min_equal])
    return np.concatenate(kept) if kept else np.zeros((0, 2), np.int64)


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
    chunks = [(list(texts[s:s + cfg.chunk_docs]), cfg) for s in range(0, len(texts), cfg.chunk_docs)]
    parts = engine.map(_chunk_task, chunks)
    sigs = np.concatenate([np.zeros((0, cfg.num_perm), np.uint32), *(p[0] for p in parts)])
    keys = np.concatenate([np.zeros((0, cfg.bands), _U64), *(p[1] for p in parts)])
    # documents with words: a real signature holds 108 values of 2**32, not all the maximum
    active = ~(sigs == _EMPTY_SIG).all(axis=1)
    m, n = len(index), len(texts)
    candidates = _candidate_pairs(index, keys, active, cfg, engine)
    verified = _verify(candidates, index, sigs, cfg)
    roots = _components(m + n, verified)
    root = roots[m:]
    keep = root == np.arange(m, m + n)
    sizes = np.bincount(roots, minlength=m + n)
    in_cluster = sizes[root] >= 2
    cluster_roots = np.unique(root[in_cluster])
    cluster = np.full(n, -1, np.int64)
    cluster[in_cluster] = np.searchsorted(cluster_roots, root[in_cluster])
    names = np.concatenate([index.ids, np.asarray(ids, dtype=str)]) if n else index.ids
    representative = [None if k else str(names[r]) for k, r in zip(keep, root)]
    kept = np.flatnonzero(keep & active)  # documents without words have nothing to match later
    return DedupResult(
        keep=keep, cluster=cluster, representative=representative,
        index=index.extend([ids[i] for i in kept], sigs[kept], keys[kept]),
        candidate_pairs=len(candidates), verified_pairs=len(verified),
        near_duplicates=int((~keep).sum()), clusters=len(cluster_roots),
        removed_by_index=int((~keep & (root < m)).sum()))
