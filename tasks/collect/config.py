"""The collect stage's contract without its processing code: `Config` (with the cleaning chain's
thresholds, `CleaningConfig`), `VERSION` and `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so this module imports neither datatrove, spaCy, trafilatura nor Ray; `run` is in stage.py and the
cleaning chain that reads `CleaningConfig` in clean/cleaning.py.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator

from gristmill.core.decontam import DecontamConfig
from gristmill.core.sources import fingerprint_sources, parse_source, source_sizes
from gristmill.core.stage import StageConfig
from gristmill.tasks.collect.clean.langid import model_languages
from gristmill.tasks.collect.clean.pii import PII_KINDS, PiiKind
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

# (n-gram length in words, fraction of the document's characters)
NgramFrac = tuple[Annotated[int, Field(ge=1)], Annotated[float, Field(ge=0, le=1)]]
_DOMAIN = re.compile(r"^[a-z0-9_-]+(?:\.[a-z0-9_-]+)*$")


class CleaningConfig(StageConfig):
    """URL, language, Gopher, FineWeb, C4 and PII settings of the cleaning chain.

    The defaults are the published thresholds, as datatrove 0.10's blocks default to them
    (LanguageFilter, GopherQualityFilter, GopherRepetitionFilter, FineWebQualityFilter,
    C4QualityFilter: tests/tasks/collect/test_cleaning.py compares each with the block's signature): the values
    for web crawls (configs/web.yaml). A preset for another corpus sets what differs (tiny.yaml:
    the demo's package docs)."""

    blocked_domains: tuple[str, ...] = Field(
        default=(), description="Drop documents whose URL host is one of these domains or a subdomain "
                                "of one ('example.com' blocks 'ads.example.com', not 'myexample.com').")
    blocked_url_substrings: tuple[str, ...] = Field(
        default=(), description="Drop documents whose lowercased URL contains one of these strings.")
    allowed_languages: tuple[str, ...] | None = Field(
        default=("en",), description="Keep only documents whose most likely language (fastText "
                                     "lid.176 code: 'en', 'de', 'no' for Norwegian Bokmål...) is one of "
                                     "these; None keeps every language. English: FineWeb's, and the "
                                     "language the Gopher, FineWeb and C4 rules below are written for "
                                     "(stop words, sentence splitting; datatrove's blocks default to it).")
    min_language_score: float = Field(
        default=0.65, ge=0, le=1,
        description="Drop documents whose top language probability is below this: 0.65, "
                    "FineWeb's and datatrove's LanguageFilter's. Markdown/reST package docs (the "
                    "demo source) mix prose with code, which fastText scores lower: 0.65 drops some "
                    "of the demo documents the tiny preset keeps; tiny sets 0.5.")
    c4_filter: bool = Field(default=True, description="Apply C4's page rules (the c4_* fields).")
    c4_min_sentences: int = Field(
        default=5, ge=0, description="C4: drop pages with fewer sentences on lines that pass the line "
                                     "rules below (0: off).")
    c4_min_words_per_line: int = Field(
        default=3, ge=0, description="C4: lines with fewer whitespace words do not count as prose.")
    c4_max_word_chars: int = Field(
        default=1000, ge=1, description="C4: lines with a longer word do not count as prose.")
    c4_require_terminal_punct: bool = Field(
        default=True, description="C4: only lines ending in . ? ! \" or ' (not '...') count as prose "
                                  "(C4's rule, on in datatrove's C4QualityFilter; FineWeb's recipe turns "
                                  "it off). C4 had one paragraph per line (text of HTML pages); "
                                  "hard-wrapped Markdown/reST (the demo source) splits sentences across "
                                  "lines, so it finds 2 sentences in Flask's README and drops some of the "
                                  "demo documents the tiny preset keeps; tiny turns it off.")
    c4_drop_lorem_ipsum: bool = Field(
        default=True, description="C4: drop pages containing 'lorem ipsum' (placeholder text).")
    c4_drop_curly_bracket: bool = Field(
        default=True, description="C4: drop pages with '{' on a prose line, C4's way to remove code (on "
                                  "in datatrove's C4QualityFilter). Code examples are wanted in the demo "
                                  "source (package docs): it drops most of the demo documents the tiny "
                                  "preset keeps; tiny turns it off.")
    c4_skip_javascript_lines: bool = Field(
        default=True, description="C4: lines mentioning 'javascript' (\"please enable JavaScript\") "
                                  "do not count as prose.")
    c4_skip_policy_lines: bool = Field(
        default=True, description="C4: lines about cookies, terms of use or privacy policy do not count "
                                  "as prose.")
    fineweb_filter: bool = Field(default=True, description="Apply FineWeb's rules (the fineweb_* fields).")
    fineweb_min_punct_line_frac: float = Field(
        default=0.12, ge=0, le=1,
        description="FineWeb: drop if fewer than this fraction of non-empty lines end in "
                    "terminal punctuation: FineWeb's 0.12. In package docs code, headings and "
                    "tables end without it (median 0.16): 0.12 drops many of the demo documents "
                    "the tiny preset keeps; tiny sets 0.05.")
    fineweb_max_short_line_frac: float = Field(
        default=0.67, ge=0, le=1, description="FineWeb: drop if more than this fraction of non-empty "
                                              "lines are short (see fineweb_short_line_chars).")
    fineweb_short_line_chars: int = Field(
        default=30, ge=1, description="FineWeb: a line of at most this many characters is short.")
    fineweb_max_duplicate_line_char_frac: float = Field(
        default=0.01, ge=0, le=1,
        description="FineWeb: drop if lines repeating an earlier line hold more than this "
                    "fraction of the characters: FineWeb's 0.01. Docs repeat '```', reST "
                    "underlines and 'Parameters' headers (median 0.009): 0.01 drops many of the "
                    "demo documents the tiny preset keeps; tiny sets 0.1.")
    fineweb_max_newlines_per_word: float = Field(
        default=0.3, ge=0, description="FineWeb: drop if newlines per word exceed this (lists, menus).")
    # Gopher quality rules (datatrove GopherQualityFilter). "Words" are spaCy tokens that are not
    # pure punctuation; datatrove skips a check whose threshold is 0.
    min_words: int = Field(default=50, ge=1, description="Drop documents with fewer words.")
    max_words: int = Field(default=100_000, ge=1, description="Drop documents with more words.")
    min_mean_word_len: float = Field(
        default=3.0, ge=0, description="Drop if the mean word length (characters) is below this.")
    max_mean_word_len: float = Field(
        default=10.0, ge=0, description="Drop if the mean word length (characters) is above this.")
    max_symbol_word_ratio: float = Field(
        default=0.1, ge=0, description="Drop if '#' occurrences, or '...'/'…' occurrences, per word "
                                       "exceed this.")
    max_bullet_line_frac: float = Field(
        default=0.9, ge=0, le=1, description="Drop if more than this fraction of lines start with a "
                                             "bullet ('•' or '-').")
    max_ellipsis_line_frac: float = Field(
        default=0.3, ge=0, le=1,
        description="Drop if more than this fraction of lines end with '...' or '…'.")
    min_alpha_word_frac: float = Field(
        default=0.8, ge=0, le=1,
        description="Drop if fewer than this fraction of tokens contain a letter: Gopher's 0.8. "
                    "Gopher set it on whitespace words; datatrove counts every punctuation mark "
                    "as a token, so web prose scores 0.75-0.95 but Markdown/reST package docs "
                    "(the demo source) score 0.5-0.6: 0.8 drops nearly all of the demo documents "
                    "the tiny preset keeps; tiny sets 0.5, which still drops number tables and "
                    "code dumps.")
    min_stop_words: int = Field(
        default=2, ge=0, description="Drop if fewer than this many distinct English stop words "
                                     "(the, be, to, of, and, that, have, with) occur.")
    # Gopher repetition rules (datatrove GopherRepetitionFilter), Rae et al. 2021 Table A1.
    max_duplicate_line_frac: float = Field(
        default=0.3, ge=0, le=1,
        description="Drop if more than this fraction of lines repeat an earlier line.")
    max_duplicate_para_frac: float = Field(
        default=0.3, ge=0, le=1, description="Drop if more than this fraction of paragraphs (split at "
                                             "blank lines) repeat an earlier paragraph.")
    max_duplicate_line_char_frac: float = Field(
        default=0.2, ge=0, le=1,
        description="Drop if repeated lines hold more than this fraction of the characters.")
    max_duplicate_para_char_frac: float = Field(
        default=0.2, ge=0, le=1,
        description="Drop if repeated paragraphs hold more than this fraction of the characters.")
    max_top_ngram_char_frac: tuple[NgramFrac, ...] = Field(
        default=((2, 0.2), (3, 0.18), (4, 0.16)),
        description="(n, frac) pairs: drop if the most frequent word n-gram, times its count, "
                    "covers more than frac of the characters.")
    max_duplicate_ngram_char_frac: tuple[NgramFrac, ...] = Field(
        default=((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)),
        description="(n, frac) pairs: drop if repeated word n-grams cover more than frac of "
                    "the characters.")
    pii_kinds: tuple[PiiKind, ...] = Field(
        default=PII_KINDS, description="Personal data replaced in kept documents: email -> <EMAIL>, "
                                       "ip_address -> <IP_ADDRESS>, iban -> <IBAN>, credit_card -> "
                                       "<CREDIT_CARD>, phone -> <PHONE> (see clean/pii.py); () turns "
                                       "scrubbing off.")

    @model_validator(mode="after")
    def _check_ranges(self) -> CleaningConfig:
        if self.max_words < self.min_words:
            raise ValueError(f"max_words ({self.max_words}) must be >= min_words "
                             f"({self.min_words})")
        if self.max_mean_word_len < self.min_mean_word_len:
            raise ValueError(f"max_mean_word_len ({self.max_mean_word_len}) must be >= "
                             f"min_mean_word_len ({self.min_mean_word_len})")
        return self

    @field_validator("blocked_domains")
    @classmethod
    def _check_domains(cls, domains: tuple[str, ...]) -> tuple[str, ...]:
        normalized = tuple(d.strip().lower().removeprefix("*.").strip(".") for d in domains)
        for raw, domain in zip(domains, normalized):
            if not _DOMAIN.match(domain):
                raise ValueError(f"blocked_domains: {raw!r} is not a domain name (give hosts "
                                 f"like 'example.com', without scheme, port or path)")
        return normalized

    @field_validator("blocked_url_substrings")
    @classmethod
    def _check_substrings(cls, substrings: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in substrings):
            raise ValueError("blocked_url_substrings: an empty string would block every URL")
        return substrings

    @field_validator("allowed_languages")
    @classmethod
    def _check_languages(cls, languages: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if languages is None:
            return None
        if not languages:
            raise ValueError("allowed_languages: an empty list drops everything; use None to "
                             "keep every language")
        unknown = [code for code in languages if code not in model_languages()]
        if unknown:
            raise ValueError(f"allowed_languages: {unknown} are not lid.176 codes (e.g. 'en', "
                             f"'de', 'no' for Norwegian Bokmål, 'zh')")
        return languages


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
