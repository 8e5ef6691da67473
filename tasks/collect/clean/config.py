"""The cleaning chain's settings: `CleaningConfig`, every threshold of clean/cleaning.py's chain
(URL block list, language ID, Gopher, FineWeb, C4, PII). The collect stage's `Config` (config.py)
inherits it, so its fields are `collect.<field>`; this module, like config.py, imports no
processing code (no datatrove, spaCy or trafilatura).
"""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from gristmill.core.stage import StageConfig
from gristmill.tasks.collect.clean.langid import model_languages
from gristmill.tasks.collect.clean.pii import PII_KINDS, PiiKind

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
