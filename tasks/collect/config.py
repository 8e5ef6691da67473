"""The collect stage's contract without its processing code: `Config` (which inherits the cleaning
chain's thresholds, clean/config.py's `CleaningConfig`), `VERSION` and `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so this module imports neither datatrove, spaCy, trafilatura nor Ray; `run` is in stage.py and the
cleaning chain that reads `CleaningConfig` in clean/cleaning.py.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from gristmill.core.decontam import DecontamConfig
from gristmill.core.sources import fingerprint_sources, parse_source, source_sizes
from gristmill.tasks.collect.clean.config import CleaningConfig
from gristmill.tasks.collect.clean.quality_model import QualityConfig
from gristmill.tasks.collect.dedup.config import DedupConfig
from gristmill.tasks.collect.output.gates import GatesConfig
from gristmill.tasks.collect.output.mixing import MixConfig
from gristmill.tasks.collect.read import demo_crawl
from gristmill.tasks.collect.read.common_crawl import DEFAULT_BASE_URL, CommonCrawlSource
from gristmill.tasks.collect.read.readers import SUPPORTED_SUFFIXES

VERSION = 6  # 3: language ID, C4/FineWeb, PII, quality model, near dedup, decontamination, mixing;
# 4: near dedup checks exact Jaccard, two band layouts (dedup index format 2); 5: the dedup index
# as key-range shards (format 3), decontamination in the work units (before exact dedup); 6: work
# units spool their kept documents (a partial folder of an earlier version is not resumed)
DEDUP_INDEX_DIR = "dedup_index"  # in a collect artifact: the MinHash index a later run may extend


class NothingSurvived(ValueError):
    """No document of any source survived collection (a refresh whose new files add nothing)."""


class Config(CleaningConfig):
    """Where the raw text comes from and how it is cleaned, deduplicated and mixed."""

    unhashed_fields: ClassVar[frozenset[str]] = frozenset(
        {"num_workers", "cc_base_url", "download_retries", "download_timeout_s", "review_samples", "gates",
         "unit_mb"})

    sources: list[str] = Field(
        default_factory=lambda: [demo_crawl.DEMO_SOURCE],
        description="Inputs, in order: 'demo:python-docs' (docs of the Python packages gristmill pins), "
                    "'cc:<crawl id>[?files=N][&kind=warc|wet][&seed=S]' (Common Crawl, e.g. "
                    "'cc:CC-MAIN-2024-22?files=2&kind=wet'), or files, directories or globs on "
                    "any fsspec filesystem of .warc[.gz], .wet[.gz], .jsonl[.gz|.zst], .json.gz, "
                    ".parquet, .arrow (a `datasets` save_to_disk dir), .txt[.gz|.zst].")
    cc_base_url: str = Field(default=DEFAULT_BASE_URL, description="Where 'cc:' files are fetched from "
                                                                   "(a mirror serves the same files).")
    download_retries: int = Field(default=5, ge=0, description="Retries of a failing download.")
    download_timeout_s: float = Field(default=60.0, gt=0, description="Socket timeout of a download, s.")
    max_doc_bytes: int = Field(default=10_000_000, ge=1, description="Records larger than this are "
                                                                     "skipped (skipped_too_large).")
    max_docs_per_source: int | None = Field(
        default=None, ge=1,
        description="Cap on documents extracted per source, in input order (None: all).")
    quality: QualityConfig = Field(default_factory=QualityConfig,
                                   description="Model-based quality score (off by default).")
    near_dedup: bool = Field(default=True, description="Remove MinHash-LSH near-duplicates (the `dedup` "
                                                       "settings); exact duplicates always go.")
    dedup: DedupConfig = Field(default_factory=DedupConfig, description="MinHash-LSH settings.")
    dedup_index_from: str | None = Field(
        default=None, description="An earlier collect artifact dir: documents near-duplicating anything "
                                  "in its dedup_index/ are removed too, without re-reading its inputs "
                                  "(incremental refresh). Its index is carried into this one.")
    decontam: DecontamConfig = Field(default_factory=DecontamConfig,
                                     description="Benchmark decontamination (off: no eval sets).")
    mix: MixConfig = Field(default_factory=MixConfig, description="Per-source weights and budgets.")
    docs_per_shard: int = Field(
        default=10_000, ge=1, description="Documents per output docs/part-*.jsonl.gz file.")
    review_samples: int = Field(default=20, ge=0, description="Documents (or quarantined records) kept "
                                                              "per drop reason in review/ for inspection.")
    gates: GatesConfig = Field(
        default_factory=GatesConfig,
        description="Data gates: limits on what collect removed, checked before tokenize; one that trips waits "
                    "for a person to approve or reject (docs/operations.md#data-gates). Not hashed: they "
                    "change no output.")
    num_workers: int = Field(
        default=2, ge=1,
        description="Parallel workers the engine may use (not hashed: output is the same).")
    unit_mb: float = Field(
        default=64.0, gt=0,
        description="Size of a work unit, MB on disk: a larger input file is read by several "
                    "units in parallel (plain .jsonl in line-aligned byte ranges, WARC/WET in "
                    "runs of whole records, Parquet in runs of row groups); a smaller one, a "
                    "compressed single stream (.jsonl.gz/.zst, .txt.gz: not seekable), an Arrow "
                    "or text file and a 'cc:' download are one unit each. Units are also what a "
                    "killed run resumes by. Not hashed: the output is the same for any size.")

    @model_validator(mode="after")
    def _check_sources(self) -> Config:
        if not self.sources:
            raise ValueError("sources: give at least one source")
        return self

    @field_validator("sources")
    @classmethod
    def _check_crawls(cls, sources: list[str]) -> list[str]:
        for source in sources:  # a 'cc:' source's mistakes are found at plan time, without the network
            if parse_source(source).kind == "cc":
                CommonCrawlSource.parse(source)
        return sources


def fingerprint(config: Config) -> str:
    """Digest of the inputs: every input file's content, the demo corpus's content (the pinned
    distributions' documents: demo_crawl.corpus_digest), the crawl files chosen ('cc:' files never
    change), eval sets, reference text (or the quality model trained before) and the earlier dedup
    index. ValueError naming the sources when none has a byte to read."""
    _check_something_to_read(config.sources)
    extra = [*config.decontam.eval_sets]
    if config.quality.enabled:
        extra += [config.quality.model] if config.quality.model else config.quality.reference
    if config.dedup_index_from:
        extra.append(str(Path(config.dedup_index_from) / DEDUP_INDEX_DIR))
    inputs = fingerprint_sources(config.sources, SUPPORTED_SUFFIXES,
                                 demo_digest=lambda _: demo_crawl.corpus_digest().sha256)
    return hashlib.sha256(f"{inputs} {fingerprint_sources(extra)}".encode()).hexdigest()


def _check_something_to_read(sources: list[str]) -> None:
    """The plan's share of the stage's rule that a source yielding no document is quarantined
    while the others go on, and none yielding any is an error: sources whose files are all empty
    are known before any is read. Usually decided by the first source's listing."""
    def empty(source: str) -> bool:
        return parse_source(source).kind == "files" and \
            all(size == 0 for size in source_sizes(source, SUPPORTED_SUFFIXES).values())

    if all(map(empty, sources)):
        raise ValueError(f"collect.sources: nothing to read, every input file of {', '.join(map(repr, sources))} "
                         "is empty (0 bytes)")
