"""MinHash signatures and LSH band keys of documents, vectorized with numpy (steps 1-4 of
near.py's docstring): normalize, shingle, hash, take per-permutation minima, hash bands.

Hashes are deterministic 64-bit integer arithmetic (never Python's salted `hash()`), so a
signature is the same in every process, on every machine, in every run.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
EMPTY_SIG = np.uint32(0xFFFFFFFF)  # signature value of a document with no words
_SHINGLES_PER_BLOCK = 8_192  # shingles per [permutations x shingles] uint64 block: 7 MB at 112
# Text hashed into words and shingles at once: the prefix sums and powers of _word_hashes take
# ~40 bytes per byte of text, so a whole chunk of long pages would take hundreds of MB.
_CHARS_PER_BATCH = 1 << 20


class MinHashParams(Protocol):
    """The settings a signature depends on (dedup.DedupConfig has them), read only."""

    @property
    def shingle_words(self) -> int: ...
    @property
    def num_perm(self) -> int: ...
    @property
    def bands(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def band_layouts(self) -> int: ...
    @property
    def seed(self) -> int: ...


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


def _shingle_hashes(texts: Sequence[str], cfg: MinHashParams) -> tuple[np.ndarray, np.ndarray]:
    """(hash of every shingle of every text, in order; shingles per text).

    A document of n >= k words has n - k + 1 shingles. A document shorter than one shingle
    (0 < n < k) still gets one: its n words, with the k - n missing positions hashed as 0, so two
    short documents match only if they hold the same words in the same order. A document with
    no words has no shingles (see `_signatures`). Hashed in batches of whole texts of about
    _CHARS_PER_BATCH characters (a text's hashes do not depend on its batch)."""
    ends = np.cumsum([len(t) for t in texts], dtype=np.int64)
    cuts = [0]
    while cuts[-1] < len(texts):
        cuts.append(max(cuts[-1] + 1, int(np.searchsorted(
            ends, (ends[cuts[-1] - 1] if cuts[-1] else 0) + _CHARS_PER_BATCH, side="right"))))
    parts = [_batch_shingle_hashes(texts[a:b], cfg) for a, b in itertools.pairwise(cuts)]
    if not parts:
        return _batch_shingle_hashes([], cfg)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _batch_shingle_hashes(texts: Sequence[str], cfg: MinHashParams) -> tuple[np.ndarray, np.ndarray]:
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


def _permutations(cfg: MinHashParams) -> tuple[np.ndarray, np.ndarray]:
    consts = _splitmix64(cfg.seed, 2 * cfg.num_perm)
    return consts[:cfg.num_perm] | _U64(1), consts[cfg.num_perm:]


def _signatures(texts: Sequence[str], cfg: MinHashParams) -> np.ndarray:
    """MinHash signatures, uint32 [n_docs, bands*rows].

    Permutation p maps a shingle hash x to the high 32 bits of (a_p x + b_p) mod 2**64
    (multiply-add-shift hashing); the high half of the minimum 64-bit value is the minimum of the
    high halves, so the shift happens once per document, after the minimum. Blocks are laid out
    [permutation, shingle] so each document's minimum is a reduction over a contiguous run.
    Documents with no words get EMPTY_SIG in every position and never become candidates."""
    shingles, n_shingles = _shingle_hashes(texts, cfg)
    a, b = _permutations(cfg)
    sigs = np.full((len(texts), cfg.num_perm), EMPTY_SIG, np.uint32)
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


def minhash_signatures(texts: Sequence[str], cfg: MinHashParams) -> np.ndarray:
    """MinHash signatures of `texts`, uint32 [n_docs, bands*rows]; identical however the texts
    are chunked."""
    return _signatures(list(texts), cfg)


def band_keys(signatures: np.ndarray, cfg: MinHashParams) -> np.ndarray:
    """Bucket key of each band of each signature, uint64 [n_docs, bands * band_layouts].

    Layout 0 cuts the signature into bands of consecutive values; layout 1 reads the same values
    as a [bands, rows] matrix column by column, so each of its bands takes one value from each of
    `rows` different layout-0 bands and collides nearly independently of them. The second
    layout is a second chance for a pair whose matching values are spread over the layout-0
    bands (no extra hashing: the same signature values)."""
    n = len(signatures)
    grid = signatures.reshape(n, cfg.bands, cfg.rows)
    layouts = [grid, grid.transpose(0, 2, 1).reshape(n, cfg.bands, cfg.rows)][:cfg.band_layouts]
    rows = np.concatenate(layouts, axis=1).astype(_U64)
    keys = np.broadcast_to(_splitmix64(cfg.seed ^ 0xBA4D, rows.shape[1]), rows.shape[:2]).copy()
    for j in range(cfg.rows):
        keys = _mix(keys ^ rows[:, :, j])
    return keys


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Fraction of equal signature positions: the MinHash estimate of the Jaccard similarity."""
    return float(np.mean(sig_a == sig_b))


def shingle_sets(texts: Sequence[str], cfg: MinHashParams) -> tuple[np.ndarray, np.ndarray]:
    """The distinct shingle hashes of each text, sorted, as one array and per-text offsets
    (text i's set is values[offsets[i]:offsets[i + 1]])."""
    shingles, n_shingles = _shingle_hashes(list(texts), cfg)
    doc = np.repeat(np.arange(len(n_shingles)), n_shingles)
    order = np.lexsort((shingles, doc))
    shingles, doc = shingles[order], doc[order]
    first = np.r_[True, (shingles[1:] != shingles[:-1]) | (doc[1:] != doc[:-1])]
    counts = np.bincount(doc[first], minlength=len(n_shingles))
    return shingles[first], np.r_[0, np.cumsum(counts)]


def exact_jaccards(values: np.ndarray, offsets: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """|A & B| / |A | B| of the shingle sets (as from `shingle_sets`) of each pair [k, 2]; 1.0
    for two empty sets. Both sets of all pairs are sorted together under a pair id; since each
    set has distinct values, a value equal to its successor within a pair is in both sets."""
    sizes = np.diff(offsets)
    parts = sizes[pairs].ravel()  # A's size, B's size, for each pair in turn
    starts = offsets[pairs].ravel()
    owner = np.repeat(np.arange(len(pairs)), sizes[pairs].sum(axis=1))
    within = np.arange(parts.sum()) - np.repeat(np.cumsum(parts) - parts, parts)
    vals = values[np.repeat(starts, parts) + within]
    order = np.lexsort((vals, owner))
    vals, owner = vals[order], owner[order]
    both = (vals[1:] == vals[:-1]) & (owner[1:] == owner[:-1])
    inter = np.bincount(owner[1:][both], minlength=len(pairs))
    union = sizes[pairs].sum(axis=1) - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def exact_jaccard(a: str, b: str, cfg: MinHashParams) -> float:
    """Exact Jaccard similarity of two texts' shingle sets (1.0 for two texts without words)."""
    return float(exact_jaccards(*shingle_sets([a, b], cfg), np.array([[0, 1]]))[0])


def chunk_signatures(item: tuple[Sequence[str], MinHashParams]) -> tuple[np.ndarray, np.ndarray]:
    """(signatures, bucket keys) of one chunk of documents."""
    texts, cfg = item
    sigs = _signatures(list(texts), cfg)  # a lazy view of spooled texts is read here, once
    return sigs, band_keys(sigs, cfg)
