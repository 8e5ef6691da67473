"""Benchmark contamination by n-gram overlap (13-grams of normalized words, as GPT-3, OLMo).

Used in both directions: the collect stage drops crawled documents that contain a benchmark item,
and the evaluate stage marks each benchmark item whose n-grams occur in a model's training data.

Evaluation sets are files or folders of JSONL (optionally gzipped) or Parquet records. A small
table (`SHAPES`) says, per record shape, which fields make up the text of an item (question,
passage, answer, choices); each item is indexed as the hashes of its word n-grams. A crawled
document is contaminated with an item when it shares at least `min_overlapping_ngrams` of them.

Normalization: NFKC, case-folded, words = runs of letters/digits (`\\w+`), so punctuation,
markup and whitespace differences between a benchmark file and a web copy do not hide a match.
N-grams are hashed to 64 bits (per-word BLAKE2b, then a polynomial over the window): stable
across processes, unlike Python's salted `hash()`, and with ~1e6 indexed n-grams the chance of a
spurious collision per document n-gram is ~1e-13.

The index is picklable (numpy arrays), so `find` can run on engine workers; findings are merged
on the driver with `record`, and `report()` is the JSON the evaluate stage shows.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from gristmill.core.files import JsonLinesError, iter_jsonl
from gristmill.core.sources import source_files

DROP_REASON = "benchmark_contamination"  # a crawled document's drop reason in the collect funnel
EVAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_WORD = re.compile(r"\w+")
_MULT = np.uint64(0x100000001B3)  # FNV-64 prime: odd, so the window polynomial mixes every word
_LABEL = re.compile(r"\b(?:Passage|Question|Answer):\s*")  # MosaicML ICL prompt labels
_CALC = re.compile(r"<<[^>]*>>")  # GSM8K calculator annotations, absent from web copies


class DecontamConfig(BaseModel):
    """Which evaluation sets to protect, and what counts as an overlap."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eval_sets: list[str] = Field(
        default_factory=list,
        description="Evaluation sets: files (.jsonl, .jsonl.gz, .parquet) or folders of them. "
                    "The benchmark name is the folder name, or the file name without suffixes.")
    ngram_words: int = Field(default=13, ge=1, description="N-gram length in normalized words "
                                                           "(13 as in GPT-3 and OLMo).")
    min_overlapping_ngrams: int = Field(
        default=1, ge=1, description="Distinct shared n-grams that flag a document for an item (an item "
                                     "with fewer n-grams needs all of them).")
    min_item_words: int = Field(
        default=5, ge=1, description="Items with fewer normalized words are not indexed: a 1-4 word text "
                                     "('yes', 'a marsh') occurs in countless unrelated documents.")
    max_docs_listed: int = Field(default=20, ge=0, description="Document ids listed per found item in "
                                                               "the report (the counts are complete).")


def normalize_words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


@lru_cache(maxsize=1 << 20)
def _token_hash(token: str) -> int:
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")


def token_hashes(tokens: Iterable[str]) -> np.ndarray:
    """Stable 64-bit hash of each token (uint64)."""
    return np.fromiter((_token_hash(t) for t in tokens), dtype=np.uint64)


def ngram_hashes(hashes: np.ndarray, n: int) -> np.ndarray:
    """Hash of every window of `n` consecutive token hashes (uint64; empty if fewer tokens)."""
    count = len(hashes) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    acc = np.full(count, n, dtype=np.uint64)  # seeding with n keeps different lengths apart
    for offset in range(n):  # uint64 arithmetic wraps mod 2**64, which is what a hash wants
        acc = acc * _MULT + hashes[offset:offset + count]
    return acc


# ---- what text an item is, per record shape ---------------------------------------------------
def _join(*parts: Any) -> str:
    """Field values as one text: the strings in them (lists, nested dicts), numbers as str."""
    return " ".join(" ".join(all_strings(p)) if isinstance(p, (list, tuple, dict)) else str(p)
                    for p in parts)


def all_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from all_strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from all_strings(v)


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A record shape of an evaluation file and the text of its items."""

    name: str
    fields: tuple[str, ...]  # joined in this order into the item's text (lists: all entries)
    also_has: tuple[str, ...] = ()  # further fields that tell this shape from another
    one_text_per: str | None = None  # a list field each of whose entries makes its own text


# First match wins, so a shape comes before any shape whose fields it includes. Choices are
# joined to their question: quiz pages print them together, and a lone choice ("a marsh")
# proves nothing.
SHAPES: list[Shape] = [
    Shape(name="question_choices", fields=("question", "choices")),  # MMLU, HF ARC ({text, label} choices)
    Shape(name="gsm8k", fields=("question", "answer")),
    Shape(name="icl_multiple_choice", fields=("query", "choices")),  # MosaicML ICL: ARC, BoolQ, COPA, OBQA
    Shape(name="hellaswag", fields=("ctx", "endings")),
    # both fillings of the blank, each a whole sentence
    Shape(name="winogrande", fields=("context_options", "continuation"), one_text_per="context_options"),
    Shape(name="lambada", fields=("context", "continuation")),
    Shape(name="piqa", fields=("goal", "sol1", "sol2")),
]
# A shape we have no entry for is still protected: indexing every string field over-flags (ids,
# labels add a few extra n-grams) rather than silently missing contamination.
FALLBACK = "all_string_fields"
_ID_FIELDS = ("id", "ind", "question_id", "idx")


def _clean(text: str) -> str:
    """Drop benchmark-file formatting that web copies do not have."""
    return _CALC.sub("", _LABEL.sub("", text))


def item_texts(record: dict) -> tuple[str, list[str]]:
    """(shape name, texts of the item) for one evaluation record."""
    for shape in SHAPES:
        if set(shape.fields + shape.also_has) <= record.keys():
            variants = record[shape.one_text_per] if shape.one_text_per else [None]
            return shape.name, [
                _clean(_join(*(variant if field == shape.one_text_per else record[field]
                               for field in shape.fields))) for variant in variants]
    return FALLBACK, [" ".join(all_strings(record))]


def _read_records(path: Path) -> Iterator[dict]:
    if path.name.endswith(".parquet"):
        import pyarrow.parquet as pq
        yield from pq.read_table(path).to_pylist()
        return
    try:
        yield from iter_jsonl([path], objects_only=True)
    except JsonLinesError as error:  # names the file and line
        raise ValueError(f"eval set file {error}") from None


def eval_files(source: str) -> tuple[str, list[Path]]:
    """(benchmark name, its local files) of one `eval_sets` entry (a file or folder, core.sources);
    ValueError naming it if it is missing or holds no eval file. The name is the folder's, or
    the file's without its suffixes."""
    found = source_files(str(Path(source).expanduser()), EVAL_SUFFIXES)
    files = [f for f in found if isinstance(f, Path)]
    if len(files) != len(found):
        raise ValueError(f"eval_sets entry {source!r}: benchmark files must be local")
    path = Path(source).expanduser()
    name = path.name if path.is_dir() else re.sub(r"(\.[a-z]+)+$", "", path.name)
    return name, files


# ---- the index ----------------------------------------------------------------------------------
class DecontamIndex:
    """Sorted n-gram hashes → items; `find` is pure, `record`/`report` accumulate findings."""

    def __init__(self, cfg: DecontamConfig, keys: np.ndarray, item_of_key: np.ndarray,
                 items: list[tuple[str, str]], ngrams_per_item: np.ndarray,
                 ngram_lengths: list[int], benchmarks: dict[str, dict[str, Any]]):
        order = np.argsort(keys, kind="stable")
        self.cfg, self.keys, self.item_of_key = cfg, keys[order], item_of_key[order]
        self.items, self.ngrams_per_item = items, ngrams_per_item
        self.ngram_lengths = ngram_lengths  # ngram_words, and the lengths of short items
        self.benchmarks = benchmarks
        self.documents_checked = 0
        self.found: dict[tuple[str, str], list[str]] = defaultdict(list)  # item -> doc ids

    def find(self, text: str) -> list[tuple[str, str]]:
        """(benchmark, item id) of every indexed item the text overlaps, sorted."""
        hashes = token_hashes(normalize_words(text))
        query = np.unique(np.concatenate([ngram_hashes(hashes, n) for n in self.ngram_lengths]))
        left = np.searchsorted(self.keys, query, "left")
        right = np.searchsorted(self.keys, query, "right")
        hit = right > left
        if not hit.any():
            return []
        ranges = [self.item_of_key[a:b] for a, b in zip(left[hit], right[hit])]
        counts = np.bincount(np.concatenate(ranges), minlength=len(self.items))
        needed = np.minimum(self.cfg.min_overlapping_ngrams, self.ngrams_per_item)
        return sorted(self.items[i] for i in np.flatnonzero(counts >= needed))

    def record(self, doc_id: str, matches: list[tuple[str, str]]) -> None:
        """Count one checked document and remember which items it contains."""
        self.documents_checked += 1
        for item in matches:
            self.found[item].append(doc_id)

    def report(self) -> dict[str, Any]:
        """Per benchmark: items indexed, items found, the documents they were found in."""
        benchmarks = {}
        for name, info in sorted(self.benchmarks.items()):
            found = {item_id: docs for (bench, item_id), docs in sorted(self.found.items())
                     if bench == name}
            flagged = {doc for docs in found.values() for doc in docs}
            listed = {item: docs[:self.cfg.max_docs_listed] for item, docs in found.items()}
            benchmarks[name] = {**info, "items_found": len(found),
                                "documents_flagged": len(flagged), "found": listed}
        all_flagged = {doc for docs in self.found.values() for doc in docs}
        return {"ngram_words": self.cfg.ngram_words,
                "min_overlapping_ngrams": self.cfg.min_overlapping_ngrams,
                "documents_checked": self.documents_checked,
                "documents_flagged": len(all_flagged), "benchmarks": benchmarks}


def drop_reason(matches: list[tuple[str, str]]) -> str | None:
    """The collect stage's drop reason for a document with these matches."""
    return DROP_REASON if matches else None


def _item_ngrams(texts: list[str], cfg: DecontamConfig) -> tuple[np.ndarray, set[int]]:
    """Distinct n-gram hashes of an item's texts and their lengths in words; a text shorter than
    `ngram_words` is one n-gram of its own length, a text shorter than `min_item_words` none."""
    grams, lengths = [], set()
    for words in (normalize_words(t) for t in texts):
        if len(words) >= cfg.min_item_words:
            n = min(cfg.ngram_words, len(words))
            grams.append(ngram_hashes(token_hashes(words), n))
            lengths.add(n)
    return (np.unique(np.concatenate(grams)) if grams else np.empty(0, np.uint64)), lengths


def build_index(cfg: DecontamConfig) -> DecontamIndex:
    """Read every eval set and index its items' n-grams (see `index_items`)."""
    benchmarks: dict[str, list[tuple[str, dict]]] = {}
    for source in cfg.eval_sets:
        name, files = eval_files(source)
        if name in benchmarks:
            raise ValueError(f"eval_sets: two entries are both named {name!r}; rename a folder")
        benchmarks[name] = []
        for path in files:
            prefix = f"{path.name}:" if len(files) > 1 else ""
            for line_no, record in enumerate(_read_records(path)):
                item_key = next((record[f] for f in _ID_FIELDS if f in record), line_no)
                benchmarks[name].append((f"{prefix}{item_key}", record))
    return index_items(cfg, benchmarks)


def index_items(cfg: DecontamConfig, benchmarks: dict[str, list[tuple[str, dict]]]) -> DecontamIndex:
    """Index the n-grams of benchmark items given as {benchmark: [(item id, record)]}.

    A text shorter than `ngram_words` is indexed whole, as one n-gram of its own length: short
    items (COPA premises, PIQA goals) would otherwise never be found, and a whole 5-12 word
    item verbatim in a document is as strong a sign as a 13-gram of a long one."""
    keys, items, ngrams_per_item, lengths = [], [], [], {cfg.ngram_words}
    infos: dict[str, dict[str, Any]] = {}
    for name, records in benchmarks.items():
        info = infos[name] = {"items_indexed": 0, "items_too_short": 0, "ngrams_indexed": 0,
                              "shapes": {}}
        for item_id, record in records:
            shape, texts = item_texts(record)
            info["shapes"][shape] = info["shapes"].get(shape, 0) + 1
            grams, item_lengths = _item_ngrams(texts, cfg)
            if len(grams) == 0:
                info["items_too_short"] += 1
                continue
            items.append((name, str(item_id)))
            keys.append(grams)
            ngrams_per_item.append(len(grams))
            lengths |= item_lengths
            info["items_indexed"] += 1
            info["ngrams_indexed"] += len(grams)
    counts = np.array(ngrams_per_item, dtype=np.int64)
    item_of_key = np.repeat(np.arange(len(items), dtype=np.int64), counts)
    all_keys = np.concatenate(keys) if keys else np.empty(0, dtype=np.uint64)
    return DecontamIndex(cfg, all_keys, item_of_key, items, counts, sorted(lengths), infos)
