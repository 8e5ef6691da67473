"""The per-document cleaning chain of the collect stage: `clean_documents(docs, cfg)` over a batch
of (text, url) pairs, each step over the batch before the next; `clean_document(text, url, cfg)`
for one.

Order (the first filter that rejects a document decides its reason, so each drop counts once):

    URL block list → language ID → Gopher quality → Gopher repetition → FineWeb → C4 → PII scrub

Cheapest and most selective first (costs per document: docs/benchmarks.md). The URL check reads
the URL only and a blocked site goes whatever its text says. Language ID is one fastText call on
a 4000-character prefix and on a multilingual crawl removes most documents before any
tokenization. The four quality filters share one rules.Page: its spaCy
words and its lines are computed once, by the first filter that needs them (Gopher quality,
which drops the most), and reused by the others. C4 tokenizes lines to count sentences, only
until it has enough, and drops the fewest documents once the others have run, so it comes last.
PII is scrubbed only in kept documents: it changes text, never the verdict.

`CleaningConfig` (clean/config.py) holds every threshold of the chain; the collect stage's Config
inherits it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gristmill.tasks.collect.clean.filters as text_filters
from gristmill.core.clock import NO_CLOCK, StepClock
from gristmill.tasks.collect.clean.config import CleaningConfig
from gristmill.tasks.collect.clean.langid import detect_language
from gristmill.tasks.collect.clean.pii import scrub_pii
from gristmill.tasks.collect.clean.rules import Page


@dataclass(frozen=True, kw_only=True)
class CleanOutcome:
    """What the chain decided for one document."""

    reason: str | None  # None: kept; else the snake_case drop reason
    text: str  # PII-scrubbed when kept, the input text when dropped
    language: str | None = None  # fastText code; None when dropped before language ID
    language_score: float | None = None
    pii_counts: dict[str, int] = field(default_factory=dict)  # kind -> replacements

    @property
    def kept(self) -> bool:
        return self.reason is None


# (switch attribute on cfg or None for always on, filter); in the chain's order.
QUALITY_FILTERS: tuple[tuple[str | None, Callable[[Page, Any], str | None]], ...] = (
    (None, text_filters.gopher_quality),
    (None, text_filters.gopher_repetition),
    ("fineweb_filter", text_filters.fineweb_quality),
    ("c4_filter", text_filters.c4_quality),
)


def clean_documents(docs: Sequence[tuple[str, str]], cfg: Any, clock: StepClock = NO_CLOCK) -> list[CleanOutcome]:
    """The chain over (text, url) pairs, outcomes in order: each step over every document still
    in before the next step (the URL check over all, fastText over those left, ...), so one
    step's model, tables and caches stay in the CPU's caches across the batch instead of being
    evicted by the other steps at every document. `cfg` is a CleaningConfig (or the collect Config,
    which extends it); `clock` is charged each step's seconds (timing.py). Also one picklable unit
    of engine work."""
    reasons: list[str | None] = [text_filters.url_blocked(url, cfg) for _, url in docs]
    clock.lap("url_filter")
    languages: list[tuple[str | None, float | None]] = [(None, None)] * len(docs)
    for i, (text, _) in enumerate(docs):
        if reasons[i] is None:
            languages[i] = language, score = detect_language(text)
            reasons[i] = text_filters.language_drop_reason(language, score, cfg)
    clock.lap("language_id")
    for i, (text, _) in enumerate(docs):
        if reasons[i] is None:
            page = Page(text)
            for switch, quality_filter in QUALITY_FILTERS:
                if switch is None or getattr(cfg, switch):
                    reasons[i] = quality_filter(page, cfg)
                    if reasons[i] is not None:
                        break
    clock.lap("quality_filters")
    outcomes = []
    for (text, _), reason, (language, score) in zip(docs, reasons, languages):
        pii_counts: dict[str, int] = {}
        if reason is None:  # PII is scrubbed in kept documents only: it changes text, never the verdict
            text, pii_counts = scrub_pii(text, cfg.pii_kinds)
        outcomes.append(CleanOutcome(reason=reason, text=text, language=language, language_score=score,
                                     pii_counts=pii_counts))
    clock.lap("pii")
    return outcomes


def clean_document(text: str, url: str, cfg: CleaningConfig) -> CleanOutcome:
    """The chain on one extracted document (`clean_documents` of one)."""
    return clean_documents([(text, url)], cfg)[0]
