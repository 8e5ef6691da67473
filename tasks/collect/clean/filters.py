"""Per-document filters for the collect stage: the Gopher, C4 and FineWeb quality rules, a URL
block list and a language filter.

Each filter is a plain function `f(page, cfg) -> str | None` (`url_blocked` takes the URL):
`page` is a text or a rules.Page (the chain passes one Page to every quality filter so the
words and lines are computed once); None keeps the document, a string is a snake_case drop
reason: datatrove's own for Gopher (e.g. "gopher_short_doc", "dup_line_frac"), datatrove's
prefixed with "c4_"/"fineweb_" for those blocks (datatrove's bare "empty" or
"too_few_sentences" would not say which filter spoke); the stage turns reasons into
`dropped_<reason>` counters. `cfg` is anything with the attributes named in the field maps
below (a tasks.collect.clean.config.CleaningConfig).

The rules are rules.py's, which decide exactly as datatrove's blocks do (tests/tasks/collect/test_rules.py)
at a fraction of the cost. The blocks themselves stay reachable through `block_for`, built once
per process and per threshold set, as the reference the tests and `python -m bench clean`
compare against. C4's block also rewrites the text it keeps (only the lines its rules keep,
each stripped, blank lines gone); here it only decides, the text is left whole: that rewrite
flattens code indentation and paragraphs.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)
from datatrove.pipeline.filters.base_filter import BaseFilter

from gristmill.tasks.collect.clean import rules
from gristmill.tasks.collect.clean.langid import detect_language
from gristmill.tasks.collect.clean.rules import Page

# Config field -> constructor argument. datatrove skips a check whose threshold is falsy (0).
GOPHER_QUALITY_ARGS: Mapping[str, str] = {
    "min_words": "min_doc_words",
    "max_words": "max_doc_words",
    "min_mean_word_len": "min_avg_word_length",
    "max_mean_word_len": "max_avg_word_length",
    "max_symbol_word_ratio": "max_symbol_word_ratio",
    "max_bullet_line_frac": "max_bullet_lines_ratio",
    "max_ellipsis_line_frac": "max_ellipsis_lines_ratio",
    # datatrove's name is misleading: it is the minimum fraction of words with a letter
    "min_alpha_word_frac": "max_non_alpha_words_ratio",
    "min_stop_words": "min_stop_words",
}
GOPHER_REPETITION_ARGS: Mapping[str, str] = {
    "max_duplicate_line_frac": "dup_line_frac",
    "max_duplicate_para_frac": "dup_para_frac",
    "max_duplicate_line_char_frac": "dup_line_char_frac",
    "max_duplicate_para_char_frac": "dup_para_char_frac",
    "max_top_ngram_char_frac": "top_n_grams",
    "max_duplicate_ngram_char_frac": "dup_n_grams",
}
C4_QUALITY_ARGS: Mapping[str, str] = {
    "c4_min_sentences": "min_num_sentences",
    "c4_min_words_per_line": "min_words_per_line",
    "c4_max_word_chars": "max_word_length",
    "c4_require_terminal_punct": "filter_no_terminal_punct",
    "c4_drop_lorem_ipsum": "filter_lorem_ipsum",
    "c4_drop_curly_bracket": "filter_curly_bracket",
    "c4_skip_javascript_lines": "filter_javascript",
    "c4_skip_policy_lines": "filter_policy",
}
FINEWEB_QUALITY_ARGS: Mapping[str, str] = {
    "fineweb_min_punct_line_frac": "line_punct_thr",
    "fineweb_max_short_line_frac": "short_line_thr",
    "fineweb_short_line_chars": "short_line_length",
    "fineweb_max_duplicate_line_char_frac": "char_duplicates_ratio",
    "fineweb_max_newlines_per_word": "new_line_ratio",
}
_BLOCKS: Mapping[str, tuple[type[BaseFilter], Mapping[str, str]]] = {
    "gopher_quality": (GopherQualityFilter, GOPHER_QUALITY_ARGS),
    "gopher_repetition": (GopherRepetitionFilter, GOPHER_REPETITION_ARGS),
    "c4_quality": (C4QualityFilter, C4_QUALITY_ARGS),
    "fineweb_quality": (FineWebQualityFilter, FINEWEB_QUALITY_ARGS),
}


@lru_cache(maxsize=16)
def _build_block(kind: str, kwargs: tuple[tuple[str, Any], ...]) -> BaseFilter:
    block_class, _ = _BLOCKS[kind]
    return block_class(**dict(kwargs))


def block_kwargs(kind: str, cfg: Any) -> dict[str, Any]:
    """Constructor arguments of datatrove filter `kind` for `cfg`'s thresholds."""
    _, field_to_arg = _BLOCKS[kind]
    return {arg: getattr(cfg, field) for field, arg in field_to_arg.items()}


def block_for(kind: str, cfg: Any) -> BaseFilter:
    """The datatrove filter `kind` with `cfg`'s thresholds, built once per process."""
    return _build_block(kind, tuple(block_kwargs(kind, cfg).items()))


def _prefixed(prefix: str, reason: str | None) -> str | None:
    return None if reason is None else prefix + reason


def gopher_quality(page: Page | str, cfg: Any) -> str | None:
    """Gopher quality rules (Rae et al. 2021, A.1.1): length, word length, symbols, bullets,
    ellipses, alphabetic words, stop words."""
    return rules.gopher_quality(Page.of(page), cfg)


def gopher_repetition(page: Page | str, cfg: Any) -> str | None:
    """Gopher repetition rules (Rae et al. 2021, Table A1): duplicate lines and paragraphs,
    top n-grams and duplicated n-grams, as fractions of the document's characters."""
    return rules.gopher_repetition(Page.of(page), cfg)


def c4_quality(page: Page | str, cfg: Any) -> str | None:
    """C4's page rules (Raffel et al. 2020, 2.2): too few sentences on lines that look like
    prose, "lorem ipsum", optionally curly brackets (C4's code detector)."""
    return _prefixed("c4_", rules.c4_quality(Page.of(page), cfg))


def fineweb_quality(page: Page | str, cfg: Any) -> str | None:
    """FineWeb's line rules (Penedo et al. 2024): share of lines ending in punctuation, share of
    short lines, characters in duplicated lines, newlines per word (lists)."""
    return _prefixed("fineweb_", rules.fineweb_quality(Page.of(page), cfg))


@lru_cache(maxsize=4)
def _url_matcher(domains: tuple[str, ...],
                 substrings: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    return (frozenset(d.lower().strip(".") for d in domains),
            tuple(s.lower() for s in substrings))


def url_host(url: str) -> str:
    """The lowercased host of a URL without port or trailing dot; "" when it has none."""
    try:
        return (urlsplit(url.strip()).hostname or "").rstrip(".")
    except ValueError:  # e.g. an unbalanced IPv6 bracket
        return ""


def url_blocked(url: str, cfg: Any) -> str | None:
    """"url_blocked" when the URL's host or one of its parent domains is in
    `cfg.blocked_domains` (so "ads.example.com" is blocked by "example.com", "myexample.com"
    is not), or the lowercased URL contains one of `cfg.blocked_url_substrings`."""
    domains, substrings = _url_matcher(tuple(cfg.blocked_domains),
                                       tuple(cfg.blocked_url_substrings))
    if not url or not (domains or substrings):
        return None
    labels = url_host(url).split(".")
    if any(".".join(labels[i:]) in domains for i in range(len(labels))):
        return "url_blocked"
    lowered = url.lower()
    if any(s in lowered for s in substrings):
        return "url_blocked"
    return None


def language_drop_reason(language: str, score: float, cfg: Any) -> str | None:
    """"language_not_allowed" when `language` is not in `cfg.allowed_languages` (None: any
    language), "language_score_low" when its probability is below `cfg.min_language_score`."""
    if cfg.allowed_languages is not None and language not in cfg.allowed_languages:
        return "language_not_allowed"
    if score < cfg.min_language_score:
        return "language_score_low"
    return None


def language_filter(text: str, cfg: Any) -> str | None:
    """`language_drop_reason` of the language fastText detects in `text` (langid.py)."""
    return language_drop_reason(*detect_language(text), cfg)
