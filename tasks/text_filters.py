"""Per-document quality heuristics for the collect stage (Gopher-style, Rae et al. 2021).

Each filter is a plain function `f(text, cfg) -> str | None`: None keeps the document, a string
is the snake_case reason it was dropped; the stage turns reasons into `dropped_<reason>` counters.
`cfg` is anything with the threshold attributes below (the collect stage's Config).
Words are whitespace-separated tokens: cheap, language-agnostic enough for a foundation, and the
thresholds below were chosen for that definition.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol


class FilterThresholds(Protocol):
    min_words: int
    max_words: int
    min_mean_word_len: float
    max_mean_word_len: float
    max_symbol_word_ratio: float
    min_alpha_word_frac: float
    max_duplicate_line_frac: float


def _words(text: str) -> list[str]:
    return text.split()


def word_count(text: str, cfg: FilterThresholds) -> str | None:
    """Too short pages are navigation/boilerplate; huge ones are dumps (lists, logs)."""
    n_words = len(_words(text))
    if n_words < cfg.min_words:
        return "too_few_words"
    if n_words > cfg.max_words:
        return "too_many_words"
    return None


def mean_word_length(text: str, cfg: FilterThresholds) -> str | None:
    """Mean word length in characters outside [min, max] flags gibberish, URLs, base64, tables."""
    words = _words(text)
    if not words:
        return "too_few_words"
    mean_len = sum(len(w) for w in words) / len(words)
    if mean_len < cfg.min_mean_word_len:
        return "mean_word_length_too_short"
    if mean_len > cfg.max_mean_word_len:
        return "mean_word_length_too_long"
    return None


def symbol_ratio(text: str, cfg: FilterThresholds) -> str | None:
    """Hash marks and ellipses per word: tag clouds and truncated teaser lists are full of them."""
    n_words = len(_words(text))
    n_symbols = text.count("#") + text.count("...") + text.count("\u2026")
    if n_words and n_symbols / n_words > cfg.max_symbol_word_ratio:
        return "too_many_symbols"
    return None


def alphabetic_words(text: str, cfg: FilterThresholds) -> str | None:
    """Fraction of words with at least one letter; low for number tables, code dumps, markup."""
    words = _words(text)
    if not words:
        return "too_few_words"
    n_alpha = sum(1 for w in words if any(c.isalpha() for c in w))
    if n_alpha / len(words) < cfg.min_alpha_word_frac:
        return "too_few_alphabetic_words"
    return None


def duplicate_lines(text: str, cfg: FilterThresholds) -> str | None:
    """Fraction of non-empty lines that repeat an earlier line: menus, footers, spam templates."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    repeats = sum(count - 1 for count in Counter(lines).values())
    if repeats / len(lines) > cfg.max_duplicate_line_frac:
        return "too_many_duplicate_lines"
    return None


# Applied in this order; the first reason wins (so each dropped document is counted once).
FILTERS: tuple[Callable[[str, FilterThresholds], str | None], ...] = (
    word_count, mean_word_length, symbol_ratio, alphabetic_words, duplicate_lines,
)


def first_drop_reason(text: str, cfg: FilterThresholds) -> str | None:
    """The reason of the first filter that rejects `text`, or None when every filter keeps it."""
    for text_filter in FILTERS:
        reason = text_filter(text, cfg)
        if reason is not None:
            return reason
    return None
