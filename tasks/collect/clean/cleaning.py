"""The per-document cleaning chain of the collect stage: `clean_document(text, url, cfg)`.

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
from gristmill.tasks.collect.clean.config import CleaningConfig
from gristmill.tasks.collect.clean.langid import detect_language
from gristmill.tasks.collect.clean.pii import scrub_pii
from gristmill.tasks.collect.clean.rules import Page
from gristmill.tasks.collect.timing import NO_CLOCK, StepClock


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


def clean_document(text: str, url: str, cfg: CleaningConfig, clock: StepClock = NO_CLOCK) -> CleanOutcome:
    """Run the chain on one extracted document; `cfg` is a CleaningConfig (or the collect
    Config, which extends it). `clock` is charged each step's seconds (timing.py)."""
    reason = text_filters.url_blocked(url, cfg)
    clock.lap("url_filter")
    if reason is not None:
        return CleanOutcome(reason=reason, text=text)
    language, score = detect_language(text)
    reason = text_filters.language_drop_reason(language, score, cfg)
    clock.lap("language_id")
    page = Page(text)
    for switch, quality_filter in QUALITY_FILTERS:
        if reason is not None:
            break
        if switch is None or getattr(cfg, switch):
            reason = quality_filter(page, cfg)
    clock.lap("quality_filters")
    if reason is not None:
        return CleanOutcome(reason=reason, text=text, language=language, language_score=score)
    text, pii_counts = scrub_pii(text, cfg.pii_kinds)
    clock.lap("pii")
    return CleanOutcome(reason=None, text=text, language=language, language_score=score,
                        pii_counts=pii_counts)


def clean_documents(docs: Sequence[tuple[str, str]], cfg: Any) -> list[CleanOutcome]:
    """`clean_document` over (text, url) pairs, in order: one picklable unit of engine work."""
    return [clean_document(text, url, cfg) for text, url in docs]
