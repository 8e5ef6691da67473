"""Stage 1, collect+clean: raw crawl (WARC/WET/JSONL or the offline demo) → clean documents.

Funnel: read records → skip non-documents (requests, images, CSS, JS, errors) → extract main text
(trafilatura) and repair Unicode (ftfy) → datatrove's Gopher quality and repetition filters
(tasks/text_filters.py) → exact dedup on normalized text → `docs/part-%05d.jsonl.gz` with
{"id", "text", "source", "url"}.
Every step's counts go to `funnel.json` and, flattened, to the stage stats.

Parallelism: one work unit per input file (or per chunk of demo packages), mapped by the injected
engine; results come back in input order and are merged serially, so the output does not depend
on the engine or the worker count.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Iterator, Mapping

from pydantic import Field, model_validator

from tasks import demo_crawl
from tasks.readers import (FILE_LEVEL_ERRORS, ReadEvent, Skipped, extract_text, read_file,
                           resolve_source)
from tasks.stage import Engine, Manifest, StageConfig, StageResult, file_digest
from tasks.text_filters import first_drop_reason

VERSION = 2  # 2: datatrove Gopher filters replace the whitespace-word heuristics
log = logging.getLogger("gristmill.collect")

DEMO_CHUNKS_PER_WORKER = 4  # several small units per worker balance uneven package sizes
# One event per record read: (reason, raw bytes, kept doc or None); reason is "kept",
# "dropped_<filter reason>", "skipped_<why>" or "error_<what>".
Event = tuple[str, int, dict[str, str] | None]
# (n-gram length in words, fraction of the document's characters)
NgramFrac = tuple[Annotated[int, Field(ge=1)], Annotated[float, Field(ge=0, le=1)]]


class Config(StageConfig):
    """Where the raw text comes from and how strictly it is cleaned."""

    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"num_workers"})

    sources: list[str] = Field(
        default_factory=lambda: [demo_crawl.DEMO_SOURCE],
        description="Inputs, in order: 'demo:python-docs' (docs of installed Python packages) "
                    "or paths, directories or globs of .warc[.gz], .warc.wet.gz, .jsonl[.gz], "
                    ".json.gz.")
    # Gopher quality rules (datatrove GopherQualityFilter). "Words" are spaCy tokens that are not
    # pure punctuation; datatrove skips a check whose threshold is 0.
    min_words: int = Field(50, ge=1, description="Drop documents with fewer words.")
    max_words: int = Field(100_000, ge=1, description="Drop documents with more words.")
    min_mean_word_len: float = Field(
        3.0, ge=0, description="Drop if the mean word length (characters) is below this.")
    max_mean_word_len: float = Field(
        10.0, ge=0, description="Drop if the mean word length (characters) is above this.")
    max_symbol_word_ratio: float = Field(
        0.1, ge=0, description="Drop if '#' occurrences, or '...'/'…' occurrences, per word "
                               "exceed this.")
    max_bullet_line_frac: float = Field(
        0.9, ge=0, le=1, description="Drop if more than this fraction of lines start with a "
                                     "bullet ('•' or '-').")
    max_ellipsis_line_frac: float = Field(
        0.3, ge=0, le=1,
        description="Drop if more than this fraction of lines end with '...' or '…'.")
    min_alpha_word_frac: float = Field(
        0.5, ge=0, le=1,
        description="Drop if fewer than this fraction of tokens contain a letter. Gopher's 0.8 "
                    "was set on whitespace words; datatrove counts every punctuation mark as a "
                    "token, so web prose scores 0.75-0.95 but Markdown/reST package docs (the "
                    "demo source) score 0.5-0.6 and 0.8 keeps 11 of 391 of them. 0.5 still drops "
                    "number tables and code dumps; use 0.8 for web crawls.")
    min_stop_words: int = Field(
        2, ge=0, description="Drop if fewer than this many distinct English stop words "
                             "(the, be, to, of, and, that, have, with) occur.")
    # Gopher repetition rules (datatrove GopherRepetitionFilter), Rae et al. 2021 Table A1.
    max_duplicate_line_frac: float = Field(
        0.3, ge=0, le=1,
        description="Drop if more than this fraction of lines repeat an earlier line.")
    max_duplicate_para_frac: float = Field(
        0.3, ge=0, le=1, description="Drop if more than this fraction of paragraphs (split at "
                                     "blank lines) repeat an earlier paragraph.")
    max_duplicate_line_char_frac: float = Field(
        0.2, ge=0, le=1,
        description="Drop if repeated lines hold more than this fraction of the characters.")
    max_duplicate_para_char_frac: float = Field(
        0.2, ge=0, le=1,
        description="Drop if repeated paragraphs hold more than this fraction of the characters.")
    max_top_ngram_char_frac: tuple[NgramFrac, ...] = Field(
        ((2, 0.2), (3, 0.18), (4, 0.16)),
        description="(n, frac) pairs: drop if the most frequent word n-gram, times its count, "
                    "covers more than frac of the characters.")
    max_duplicate_ngram_char_frac: tuple[NgramFrac, ...] = Field(
        ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)),
        description="(n, frac) pairs: drop if repeated word n-grams cover more than frac of "
                    "the characters.")
    max_docs_per_source: int | None = Field(
        None, ge=1,
        description="Cap on documents extracted per source, in input order (None: all).")
    docs_per_shard: int = Field(
        10_000, ge=1, description="Documents per output docs/part-*.jsonl.gz file.")
    num_workers: int = Field(
        2, ge=1,
        description="Parallel workers the engine may use (not hashed: output is the same).")

    @model_validator(mode="after")
    def _check_ranges(self) -> "Config":
        if not self.sources:
            raise ValueError("sources: give at least one source")
        if self.max_words < self.min_words:
            raise ValueError(f"max_words ({self.max_words}) must be >= min_words "
                             f"({self.min_words})")
        if self.max_mean_word_len < self.min_mean_word_len:
            raise ValueError(f"max_mean_word_len ({self.max_mean_word_len}) must be >= "
                             f"min_mean_word_len ({self.min_mean_word_len})")
        return self


@dataclass(frozen=True)
class WorkUnit:
    """One picklable piece of work: a file of a source, or a chunk of demo packages."""

    config: Config
    source: str
    path: str | None = None
    packages: tuple[tuple[str, str], ...] = ()


def plan_units(config: Config) -> list[WorkUnit]:
    """Work units in deterministic input order; ValueError naming a source that has no input."""
    units: list[WorkUnit] = []
    for source in config.sources:
        if source.startswith("demo:"):
            if source != demo_crawl.DEMO_SOURCE:
                raise ValueError(f"source {source!r}: unknown demo "
                                 f"(known: {demo_crawl.DEMO_SOURCE})")
            packages = demo_crawl.list_packages()
            n_chunks = max(1, min(len(packages), config.num_workers * DEMO_CHUNKS_PER_WORKER))
            bounds = [len(packages) * i // n_chunks for i in range(n_chunks + 1)]
            units += [WorkUnit(config, source, packages=tuple(packages[a:b]))
                      for a, b in zip(bounds, bounds[1:])]
        else:
            units += [WorkUnit(config, source, path=str(p)) for p in resolve_source(source)]
    return units


def _unit_records(unit: WorkUnit) -> Iterator[ReadEvent]:
    if unit.path is None:
        return demo_crawl.iter_records(unit.packages)
    return read_file(Path(unit.path))


def _document_event(item: ReadEvent, config: Config) -> Event:
    if isinstance(item, Skipped):
        return item.reason, item.nbytes, None
    try:
        text = extract_text(item)
    except ImportError:  # a missing extractor dependency is a broken install, not a bad page
        raise
    except Exception:  # one malformed page must not end the crawl; it is counted instead
        log.warning("text extraction failed for %s", item.url, exc_info=True)
        return "error_extraction", item.nbytes, None
    if text is None:
        return "skipped_no_text", item.nbytes, None
    reason = first_drop_reason(text, config)
    if reason is not None:
        return f"dropped_{reason}", item.nbytes, None
    return "kept", item.nbytes, {"text": text, "url": item.url}


def is_extracted(reason: str) -> bool:
    """Whether an event is a document that reached the quality filters."""
    return reason == "kept" or reason.startswith("dropped_")


def process_unit(unit: WorkUnit) -> list[Event]:
    """Read, extract and filter one unit; stops after `max_docs_per_source` extracted docs."""
    events: list[Event] = []
    n_extracted = 0
    for item in _unit_records(unit):
        event = _document_event(item, unit.config)
        events.append(event)
        n_extracted += is_extracted(event[0])
        cap = unit.config.max_docs_per_source
        if cap is not None and n_extracted >= cap:
            break
    return events


def text_hash(text: str) -> str:
    """sha256 of the text lowercased with whitespace collapsed: the exact-dedup key."""
    return hashlib.sha256(" ".join(text.lower().split()).encode()).hexdigest()


class Funnel:
    """Counts of every step, in total and per source, and the deduplicated kept docs."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.per_source: dict[str, Counter[str]] = {}
        self.docs: list[dict[str, str]] = []
        self._seen: set[str] = set()

    def add(self, source: str, reason: str, nbytes: int, doc: dict[str, str] | None) -> None:
        counts = self.per_source.setdefault(source, Counter())
        for c in (self.counts, counts):
            c[reason] += 1
            c["bytes_in"] += nbytes
            c["records_read"] += reason not in FILE_LEVEL_ERRORS
            c["docs_in"] += is_extracted(reason)
        if doc is None:
            return
        digest = text_hash(doc["text"])
        if digest in self._seen:  # first occurrence in input order wins
            self.counts["exact_duplicates"] += 1
            counts["exact_duplicates"] += 1
            return
        self._seen.add(digest)
        self.docs.append({"id": digest[:16], "text": doc["text"], "source": source,
                          "url": doc["url"]})
        counts["docs_out"] += 1

    def report(self) -> dict[str, Any]:
        """funnel.json: the steps in order, reasons grouped by step."""
        def group(prefix: str) -> dict[str, int]:
            return {k: v for k, v in sorted(self.counts.items()) if k.startswith(prefix)}

        texts = [d["text"] for d in self.docs]
        return {
            "records_read": self.counts["records_read"],
            "skipped": group("skipped_"),
            "errors": group("error_"),
            "docs_in": self.counts["docs_in"],
            "dropped": group("dropped_"),
            "docs_after_filters": self.counts["kept"],
            "exact_duplicates": self.counts["exact_duplicates"],
            "docs_out": len(self.docs),
            "bytes_in": self.counts["bytes_in"],
            "bytes_out": sum(len(t.encode()) for t in texts),  # UTF-8 bytes of the kept text
            "words_out": sum(len(t.split()) for t in texts),
            "per_source": {s: dict(sorted(c.items())) for s, c in self.per_source.items()},
        }


def merge(units: list[WorkUnit], results: list[list[Event]],
          max_docs_per_source: int | None) -> Funnel:
    """Fold unit results in input order, capping extracted docs per source across its units."""
    funnel = Funnel()
    for unit, events in zip(units, results):
        for reason, nbytes, doc in events:
            taken = funnel.per_source.get(unit.source, Counter())["docs_in"]
            if max_docs_per_source is not None and taken >= max_docs_per_source:
                break
            funnel.add(unit.source, reason, nbytes, doc)
    for source in dict.fromkeys(u.source for u in units):
        counts = funnel.per_source.get(source, Counter())
        if counts["docs_in"] == 0:
            raise ValueError(f"source {source!r} yielded no documents (counts: {dict(counts)})")
    return funnel


def write_shards(docs: list[dict[str, str]], docs_dir: Path, docs_per_shard: int) -> int:
    """docs/part-%05d.jsonl.gz; gzip mtime fixed at 0 so equal docs give byte-identical files."""
    if docs_dir.exists():  # left by an interrupted earlier attempt
        shutil.rmtree(docs_dir)
    docs_dir.mkdir(parents=True)
    n_shards = 0
    for n_shards, start in enumerate(range(0, len(docs), docs_per_shard), start=1):
        shard = docs[start:start + docs_per_shard]
        lines = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in shard)
        with open(docs_dir / f"part-{n_shards - 1:05d}.jsonl.gz", "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
                f.write(lines.encode())
    return n_shards


def flatten(report: dict[str, Any]) -> dict[str, int]:
    """funnel.json → flat stats (reason keys already carry their step prefix)."""
    stats: dict[str, int] = {}
    for key, value in report.items():
        if isinstance(value, dict) and key != "per_source":
            stats.update(value)
        elif not isinstance(value, dict):
            stats[key] = value
    return stats


def run(config: Config, inputs: Mapping[str, Manifest], out_dir: Path, *,
        engine: Engine) -> StageResult:
    """Read, clean and deduplicate every source into out_dir/docs; counts go to funnel.json."""
    out_dir = Path(out_dir)
    units = plan_units(config)
    log.info("collect: %d work units from %d sources", len(units), len(config.sources))
    results = engine.map(process_unit, units)
    funnel = merge(units, results, config.max_docs_per_source)
    if not funnel.docs:
        raise ValueError("no documents survived the filters; loosen the filter thresholds")
    report = funnel.report()
    report["shards"] = write_shards(funnel.docs, out_dir / "docs", config.docs_per_shard)
    (out_dir / "funnel.json").write_text(json.dumps(report, indent=2) + "\n")
    for source, counts in report["per_source"].items():
        log.info("%s: %d records read, %d documents extracted, %d kept", source,
                 counts.get("records_read", 0), counts.get("docs_in", 0), counts.get("docs_out", 0))
    log.info("collect: kept %d docs, %d words, %.2f MB", report["docs_out"], report["words_out"],
             report["bytes_out"] / 1e6)
    return StageResult(stats=flatten(report), artifacts=["funnel.json"])


def fingerprint(config: Config) -> str:
    """Digest of the inputs: every input file's content, or the installed package versions."""
    digest = hashlib.sha256()
    for source in config.sources:
        digest.update(f"source {source}\n".encode())
        if source.startswith("demo:"):
            for name, version in demo_crawl.list_packages():
                digest.update(f"{name}=={version}\n".encode())
        else:
            for path in resolve_source(source):
                digest.update(f"{path.name} {file_digest(path)}\n".encode())
    return digest.hexdigest()
