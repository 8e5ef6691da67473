"""The Gopher quality, Gopher repetition, FineWeb and C4 rules, evaluated on one `Page` whose
words, lines and n-grams are computed once and shared by every rule.

Each rule decides exactly as datatrove 0.10's block of the same name (GopherQualityFilter,
GopherRepetitionFilter, FineWebQualityFilter, C4QualityFilter) with the same thresholds, and
returns datatrove's own reason (None: kept); tests/tasks/collect/test_rules.py runs both on the shared pages and
labelled edge cases. The constants and `find_duplicates` are datatrove's, imported, not copied.

Why not call the blocks: profiled (cProfile, 300 of the shared pages, 4.3 kB on average) 85% of
the chain's time was spaCy tokenization inside them, done again and again: each block splits the
whole text into words itself (datatrove's 5-entry cache saves some of that), C4 runs spaCy's
pipeline once per line to count sentences (49% of the time), and every call runs inside spaCy's
`memory_zone`, which drops the vocabulary entries it creates, so every word of every document
is built again as a new spaCy lexeme (word shape, like_num, like_url...: 38%). Here a document's
words come from one pass over its whitespace-free chunks, each distinct chunk tokenized by spaCy
once per process (`split_words`), C4 tokenizes a line only while its sentence count can still
change the decision, and the n-gram rules count without building a string per position where
they can. The tokens are those of datatrove's `spacy.blank("en")` tokenizer, the sentence
counts those of its sentencizer (spaCy's own `predict`).
"""
from __future__ import annotations

import itertools
import re
import sys
from collections import Counter
from collections.abc import Mapping
from functools import cached_property, lru_cache
from types import MappingProxyType
from typing import Any

from datatrove.pipeline.filters.c4_filters import (
    CITATION_REGEX,
    ELLIPSIS,
    END_PUNCTUATION,
    POLICY_SUBSTRINGS,
)
from datatrove.pipeline.filters.gopher_quality_filter import STOP_WORDS
from datatrove.pipeline.filters.gopher_repetition_filter import find_duplicates
from datatrove.utils.text import (
    PUNCTUATION_SET,
    TERMINAL_PUNCTUATION,
    split_into_sentences,
    split_into_words,
)

# Bounds on what the word splitter remembers, so a worker's memory stays bounded on an endless
# crawl: spaCy's vocabulary is rebuilt and the chunk cache emptied past these sizes (what they
# hold near these bounds: docs/benchmarks.md, "The word splitter's memory").
MAX_LEXEMES = 200_000
MAX_CACHED_CHUNKS = 200_000
# Inside the memory zone datatrove tokenizes in, spaCy fails on some texts holding this string
# (e.g. "IS_ALPHA.") and datatrove then tokenizes the text without it: such (rare) texts are
# left to datatrove's own splitters, so the words are the same.
_BREAKS_SPACY = "IS_ALPHA"
_LONGEST_SPECIAL_CASE = 16  # characters of a special case's head looked at (English's are shorter)
_STOP_WORDS = frozenset(STOP_WORDS)
_TERMINAL = tuple(TERMINAL_PUNCTUATION)
_PARAGRAPHS = re.compile(r"\n{2,}")  # GopherRepetitionFilter's splitters
_LINES = re.compile("\n+")


def import_spacy() -> Any:
    """The spacy module. spaCy imports thinc, which imports torch (most of spaCy's import time)
    to offer torch-backed models; the tokenizer uses none. So a process that has not imported
    torch yet (a collect worker) imports spaCy with torch hidden, and thinc takes it as absent;
    torch itself imports as usual afterwards. Another thread importing torch in that moment
    would fail; the threads of collect's processes (Ray's, Prefect's, MLflow's) import none."""
    if "spacy" in sys.modules or "torch" in sys.modules:
        import spacy

        return spacy
    sys.modules["torch"] = None  # type: ignore[assignment]  # import torch: ImportError
    try:
        import spacy
    finally:
        if sys.modules.get("torch", "") is None:
            del sys.modules["torch"]
    return spacy


@lru_cache(maxsize=1)
def _spacy() -> Any:
    nlp = import_spacy().blank("en")  # datatrove's SpaCyTokenizer("en")
    nlp.add_pipe("sentencizer")
    return nlp


def _tokenize(text: str) -> Any:
    """spaCy's tokenizer alone (the sentencizer adds no tokens), outside a memory zone: the
    vocabulary keeps what it learns, up to MAX_LEXEMES."""
    if len(_spacy().vocab) > MAX_LEXEMES:
        _spacy.cache_clear()
    return _spacy().tokenizer(text)


# whitespace-free chunk -> (its spaCy tokens, the tails of the special cases whose head it ends
# with, by their first character: `_spans_agree` checks the next chunk against them), so that
# what the splitter remembers of a chunk is one entry, bounded and emptied as one
_chunks: dict[str, tuple[tuple[str, ...], Mapping[str, tuple[str, ...]]]] = {}
_NO_TAILS: Mapping[str, tuple[str, ...]] = MappingProxyType({})  # most chunks': shared, not one each


def clear_caches() -> None:
    """Back to a fresh worker's state (spaCy loaded, nothing learnt): for cold measurements."""
    _chunks.clear()
    _has_letter.cache_clear()
    _spacy.cache_clear()
    _spacy()


def split_words(text: str) -> list[str]:
    """datatrove's split_into_words(text) (English): spaCy's tokens, stripped, the empty ones
    (whitespace) left out.

    spaCy splits the text at whitespace first and tokenizes each whitespace-free chunk on its
    own, so the words are the tokens of `text.split()`'s chunks, in order. Each distinct chunk is
    tokenized once per process; the unseen ones of a document in one call. No word contains
    whitespace. One exception: spaCy's matcher of special cases can meet a special case's pieces
    on both sides of a space (":)" then ")" is ":))") and then splits the first chunk otherwise
    ("a:) )" is a : ) ), "a:)" alone a :)); a text where two neighbouring chunks could be such
    pieces is left to datatrove's own splitter."""
    chunks = text.split()
    if _BREAKS_SPACY in text:
        return split_into_words(text)
    distinct = list(dict.fromkeys(chunks))
    missing = [c for c in distinct if c not in _chunks]
    if missing:
        if len(_chunks) + len(missing) > MAX_CACHED_CHUNKS:
            _chunks.clear()
            missing = distinct
        _tokenize_chunks(missing)
    if not _spans_agree(chunks):
        return split_into_words(text)
    words: list[str] = []
    for chunk in chunks:
        words.extend(_chunks[chunk][0])
    return words


@lru_cache(maxsize=1)
def _special_case_pieces() -> dict[str, frozenset[str]]:
    """The special cases spaCy's matcher puts together from several tokens (those its prefix,
    suffix and infix rules split, such as ":))"), cut in two between any two of those tokens:
    head -> the tails after it."""
    from spacy.tokenizer import Tokenizer

    spacy_tokenizer = _spacy().tokenizer
    affixes_only = Tokenizer(spacy_tokenizer.vocab, prefix_search=spacy_tokenizer.prefix_search,
                             suffix_search=spacy_tokenizer.suffix_search,
                             infix_finditer=spacy_tokenizer.infix_finditer,
                             token_match=spacy_tokenizer.token_match, url_match=spacy_tokenizer.url_match)
    tails: dict[str, set[str]] = {}
    for case in spacy_tokenizer.rules:
        tokens = [token.text for token in affixes_only(case)]
        for cut in range(1, len(tokens)):
            tails.setdefault("".join(tokens[:cut]), set()).add("".join(tokens[cut:]))
    return {head: frozenset(after) for head, after in tails.items()}


def _tails_after(chunk: str) -> Mapping[str, tuple[str, ...]]:
    """The tails of the special cases whose head `chunk` ends with, by their first character:
    the next chunk must begin with one, or be the start of one, for a case to span the space
    between, so it begins with that character either way."""
    pieces = _special_case_pieces()
    by_first: dict[str, list[str]] = {}
    for size in range(1, min(len(chunk), _LONGEST_SPECIAL_CASE) + 1):
        for tail in pieces.get(chunk[-size:], ()):
            by_first.setdefault(tail[0], []).append(tail)
    return {first: tuple(tails) for first, tails in by_first.items()} if by_first else _NO_TAILS


def _spans_agree(chunks: list[str]) -> bool:
    """Whether the cached tokens of the chunks around every boundary a special case could span
    (a chunk ends with its head, the next begins its tail or is the start of it) are what spaCy
    gives those chunks together; a window of a few chunks covers a case spread over several."""
    for i, (left, right) in enumerate(itertools.pairwise(chunks)):
        tails = _chunks[left][1].get(right[0])
        if tails and any(right.startswith(tail) or tail.startswith(right) for tail in tails):
            window = chunks[max(i - 1, 0) : i + 4]
            cached = [token for chunk in window for token in _chunks[chunk][0]]
            if [token.text for token in _tokenize(" ".join(window)) if not token.is_space] != cached:
                return False
    return True


def _tokenize_chunks(chunks: list[str]) -> None:
    """Tokenize distinct chunks in one call, a newline between two: it is a token of its own
    (skipped), so no special case is matched across two unrelated chunks."""
    pieces: list[list[str]] = [[] for _ in chunks]
    k, end = 0, len(chunks[0])  # chunk k spans [end - len(chunk), end) of the joined text
    for token in _tokenize("\n".join(chunks)):
        if token.is_space:
            continue
        while token.idx >= end:
            k += 1
            end += 1 + len(chunks[k])
        pieces[k].append(token.text)
    for chunk, tokens in zip(chunks, pieces):
        _chunks[chunk] = ((chunk,) if tokens == [chunk] else tuple(tokens)), _tails_after(chunk)


def sentence_count(text: str) -> int:
    """len(datatrove.utils.text.split_into_sentences(text)): spaCy's sentencizer on `text`;
    an empty text is one (empty) sentence."""
    if _BREAKS_SPACY in text:
        return len(split_into_sentences(text))
    doc = _tokenize(text)
    return max(1, sum(_spacy().get_pipe("sentencizer").predict([doc])[0]))


class Page:
    """One document's text and what the rules read from it, each computed on first use."""

    def __init__(self, text: str):
        self.text = text
        # n -> the words' n-grams joined without a separator, as datatrove's duplicate n-gram
        # rule keys them (`_concatenated_ngrams`)
        self.word_ngrams: dict[int, list[str]] = {}

    @classmethod
    def of(cls, page: Page | str) -> Page:
        return page if isinstance(page, Page) else cls(page)

    @cached_property
    def words(self) -> list[str]:
        """`split_words`: no word contains a space, so n of them joined with spaces are one
        n-gram and only one."""
        return split_words(self.text)

    @cached_property
    def lines(self) -> list[str]:
        """str.splitlines (Gopher quality, C4)."""
        return self.text.splitlines()


def gopher_quality(page: Page, cfg: Any) -> str | None:
    """datatrove GopherQualityFilter: a falsy threshold skips its check."""
    text, words = page.text, page.words
    n_words = len(words)
    lengths = [len(w) for w in words if not PUNCTUATION_SET.issuperset(w)]
    if cfg.min_words and len(lengths) < cfg.min_words:
        return "gopher_short_doc"
    if cfg.max_words and len(lengths) > cfg.max_words:
        return "gopher_long_doc"
    mean_len = sum(lengths) / len(lengths) if lengths else float("nan")  # numpy's mean of []
    if cfg.min_mean_word_len and mean_len < cfg.min_mean_word_len:
        return "gopher_below_avg_threshold"
    if cfg.max_mean_word_len and mean_len > cfg.max_mean_word_len:
        return "gopher_above_avg_threshold"
    if cfg.max_symbol_word_ratio and text.count("#") / n_words > cfg.max_symbol_word_ratio:
        return "gopher_too_many_hashes"
    if cfg.max_symbol_word_ratio and (
            (text.count("...") + text.count("…")) / n_words > cfg.max_symbol_word_ratio):
        return "gopher_too_many_ellipsis"
    lines = page.lines
    if cfg.max_bullet_line_frac and (
            sum(s.lstrip().startswith(("•", "-")) for s in lines) / len(lines)
            > cfg.max_bullet_line_frac):
        return "gopher_too_many_bullets"
    if cfg.max_ellipsis_line_frac and (
            sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines)
            > cfg.max_ellipsis_line_frac):
        return "gopher_too_many_end_ellipsis"
    if cfg.min_alpha_word_frac and (
            sum(_has_letter(w) for w in words) / n_words < cfg.min_alpha_word_frac):
        return "gopher_below_alpha_threshold"
    if cfg.min_stop_words and len(_STOP_WORDS.intersection(words)) < cfg.min_stop_words:
        return "gopher_enough_stop_words"
    return None


@lru_cache(maxsize=1 << 16)
def _has_letter(word: str) -> bool:
    return any(c.isalpha() for c in word)


def gopher_repetition(page: Page, cfg: Any) -> str | None:
    """datatrove GopherRepetitionFilter: duplicate paragraphs and lines (by count and by
    characters), then the top n-grams and the duplicated n-grams, as fractions of the text."""
    text = page.text
    if not text:
        return "empty"
    paragraphs = _PARAGRAPHS.split(text.strip())
    duplicates, chars = find_duplicates(paragraphs)
    if cfg.max_duplicate_para_frac and duplicates / len(paragraphs) > cfg.max_duplicate_para_frac:
        return "dup_para_frac"
    if cfg.max_duplicate_para_char_frac and chars / len(text) > cfg.max_duplicate_para_char_frac:
        return "dup_para_char_frac"
    lines = _LINES.split(text)
    duplicates, chars = find_duplicates(lines)
    if cfg.max_duplicate_line_frac and duplicates / len(lines) > cfg.max_duplicate_line_frac:
        return "dup_line_frac"
    if cfg.max_duplicate_line_char_frac and chars / len(text) > cfg.max_duplicate_line_char_frac:
        return "dup_line_char_frac"
    words = page.words
    for n, frac in cfg.max_top_ngram_char_frac:
        if len(words) < n:
            continue
        # The most common n-gram (the first seen among equals, as Counter.most_common) times
        # its count, in characters of its space-joined form.
        gram, count = Counter(zip(*(words[i:] for i in range(n)))).most_common(1)[0]
        if (sum(map(len, gram)) + n - 1) * count / len(text) > frac:
            return f"top_{n}_gram"
    for n, frac in cfg.max_duplicate_ngram_char_frac:
        if _duplicate_ngram_chars(page, n) / len(text) > frac:
            return f"duplicated_{n}_n_grams"
    return None


def _concatenated_ngrams(page: Page, n: int) -> list[str]:
    grams = page.word_ngrams
    if n not in grams:
        words = page.words
        shorter = grams.get(n - 1)
        grams[n] = ([g + w for g, w in zip(shorter, words[n - 1:])] if shorter is not None
                    else ["".join(t) for t in zip(*(words[i:] for i in range(n)))])
    return grams[n]


def _duplicate_ngram_chars(page: Page, n: int) -> int:
    """datatrove's find_all_duplicate(words, n): scanning left to right, an n-gram (words
    concatenated) seen before at a scanned position counts its characters and the scan jumps
    n words ahead; otherwise it moves one word. Only n-grams occurring more than once can
    count or matter, so the scan visits just their positions."""
    grams = _concatenated_ngrams(page, n)
    if len(set(grams)) == len(grams):  # the common case, cheaper than counting
        return 0
    counts = Counter(grams)
    seen: set[str] = set()
    chars = next_scanned = 0
    for i in [i for i, g in enumerate(grams) if counts[g] > 1]:
        if i < next_scanned:  # jumped over
            continue
        gram = grams[i]
        if gram in seen:
            chars += len(gram)
            next_scanned = i + n
        else:
            seen.add(gram)
    return chars


def fineweb_quality(page: Page, cfg: Any) -> str | None:
    """datatrove FineWebQualityFilter (line_punct_exclude_zero off, its terminal marks)."""
    text = page.text
    lines = [line for line in text.split("\n") if line.strip() != ""]
    if not lines:
        return "empty"
    if sum(line.endswith(_TERMINAL) for line in lines) / len(lines) < cfg.fineweb_min_punct_line_frac:
        return "line_punct_ratio"
    short = sum(len(line) <= cfg.fineweb_short_line_chars for line in lines)
    if short / len(lines) > cfg.fineweb_max_short_line_frac:
        return "short_line_ratio"
    if (find_duplicates(lines)[1] / len(text.replace("\n", ""))
            > cfg.fineweb_max_duplicate_line_char_frac):
        return "char_dup_ratio"
    if text.count("\n") / len(page.words) > cfg.fineweb_max_newlines_per_word:
        return "list_ratio"
    return None


def c4_quality(page: Page, cfg: Any) -> str | None:
    """datatrove C4QualityFilter's decision (split on lines, citations removed); the text is
    not rewritten. Sentences are counted only until there are enough, and the scan stops there
    unless a later line can still drop the page (lorem ipsum, curly bracket)."""
    min_sentences, min_words = cfg.c4_min_sentences, cfg.c4_min_words_per_line
    page_rules = cfg.c4_drop_lorem_ipsum or cfg.c4_drop_curly_bracket
    sentences = 0
    for line in page.lines:
        line = line.strip()
        words = line.split()
        if any(len(word) > cfg.c4_max_word_chars for word in words):
            continue
        line = CITATION_REGEX.sub("", line)
        if cfg.c4_require_terminal_punct and (
                not line.endswith(END_PUNCTUATION) or line.endswith(ELLIPSIS)):
            continue
        if len(words) < min_words:
            continue
        lowered = line.lower()
        if cfg.c4_drop_lorem_ipsum and "lorem ipsum" in lowered:
            return "lorem_ipsum"
        if cfg.c4_skip_javascript_lines and "javascript" in lowered:
            continue
        if cfg.c4_drop_curly_bracket and "{" in line:
            return "curly_bracket"
        if cfg.c4_skip_policy_lines and any(p in lowered for p in POLICY_SUBSTRINGS):
            continue
        if sentences < min_sentences:
            sentences += sentence_count(line)
        elif not page_rules:
            break
    return "too_few_sentences" if sentences < min_sentences else None
