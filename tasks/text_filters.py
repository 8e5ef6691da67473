"""Per-document quality filters for the collect stage, backed by datatrove's Gopher blocks.

Each filter is a plain function `f(text, cfg) -> str | None`: None keeps the document, a string
is datatrove's own snake_case drop reason (e.g. "gopher_short_doc", "dup_line_frac"); the stage
turns reasons into `dropped_<reason>` counters. `cfg` is anything with the threshold attributes
named in the field maps below (the collect stage's Config).

The datatrove blocks are called through their `.filter(Document)` method, without a datatrove
executor, and each one is built once per process and per threshold set (building loads spaCy).
Words are datatrove's: spaCy `blank("en")` tokens, so punctuation marks count as words; the
tokenization of a text is cached inside datatrove, so the second filter does not redo it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Mapping

from datatrove.data import Document
from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
from datatrove.pipeline.filters.base_filter import BaseFilter

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
_BLOCKS: Mapping[str, tuple[type[BaseFilter], Mapping[str, str]]] = {
    "gopher_quality": (GopherQualityFilter, GOPHER_QUALITY_ARGS),
    "gopher_repetition": (GopherRepetitionFilter, GOPHER_REPETITION_ARGS),
}


@lru_cache(maxsize=16)
def _build_block(kind: str, kwargs: tuple[tuple[str, Any], ...]) -> BaseFilter:
    block_class, _ = _BLOCKS[kind]
    return block_class(**dict(kwargs))


def block_for(kind: str, cfg: Any) -> BaseFilter:
    """The datatrove filter `kind` with `cfg`'s thresholds, built once per process."""
    _, field_to_arg = _BLOCKS[kind]
    kwargs = tuple((arg, getattr(cfg, field)) for field, arg in field_to_arg.items())
    return _build_block(kind, kwargs)


def _drop_reason(block: BaseFilter, text: str) -> str | None:
    verdict = block.filter(Document(text=text, id=""))
    if verdict is True:
        return None
    _, reason = verdict  # the Gopher blocks reject with (False, reason)
    return reason


def gopher_quality(text: str, cfg: Any) -> str | None:
    """Gopher quality rules (Rae et al. 2021, A.1.1): length, word length, symbols, bullets,
    ellipses, alphabetic words, stop words."""
    return _drop_reason(block_for("gopher_quality", cfg), text)


def gopher_repetition(text: str, cfg: Any) -> str | None:
    """Gopher repetition rules (Rae et al. 2021, Table A1): duplicate lines and paragraphs,
    top n-grams and duplicated n-grams, as fractions of the document's characters."""
    return _drop_reason(block_for("gopher_repetition", cfg), text)


# Applied in this order; the first reason wins (so each dropped document is counted once).
# Quality first: it is cheaper than the n-gram scans and rejects most of what both would.
FILTERS: tuple[Callable[[str, Any], str | None], ...] = (gopher_quality, gopher_repetition)


def first_drop_reason(text: str, cfg: Any) -> str | None:
    """The reason of the first filter that rejects `text`, or None when every filter keeps it."""
    for text_filter in FILTERS:
        reason = text_filter(text, cfg)
        if reason is not None:
            return reason
    return None
