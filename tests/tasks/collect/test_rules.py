"""tasks/collect/clean/rules.py against datatrove 0.10's blocks: the same keep/drop and the same reason
on every shared WARC/JSONL page, a few corpora and labelled edge cases, under every threshold
the config exposes; the word splitter and sentence counter against datatrove's."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from datatrove.data import Document
from datatrove.pipeline.filters import (
    c4_filters,
    fineweb_quality_filter,
    gopher_quality_filter,
    gopher_repetition_filter,
)
from datatrove.utils.text import split_into_sentences, split_into_words
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gristmill.tasks.collect.clean.filters as text_filters
import gristmill.tasks.collect.clean.rules as rules
import gristmill.tasks.collect.stage as collect
from bench.harness.pages import shared_pages

CFG = collect.Config()
REPO = Path(__file__).resolve().parents[3]

PROSE_LINE = ("The committee met on Tuesday and agreed that the bridge should be repaired "
              "before the winter, with the work to be paid for by the town.")
PROSE = "\n".join(f"{PROSE_LINE[:-1]} in year {1990 + i}." for i in range(12))

# name -> text: each exercises a rule datatrove's blocks decide on
EDGE_CASES = {
    "empty": "",
    "one_word": "word",
    "only_whitespace": " \n\t \n\n",
    "only_punctuation": "!!! ... ?? -- ,,, ;; :: ()[] “” «» … — •",
    "bullets": "\n".join(f"• item number {i} is here and that is the way" for i in range(40)),
    "dash_bullets": "\n".join(f"  - point {i} of the list, with the reasons to have it"
                              for i in range(40)) + "\n" + PROSE,
    "ellipsis_lines": "\n".join(f"Read the whole story of the {i} days and the end..."
                                for i in range(30)) + "\n" + PROSE,
    "unicode_ellipsis": "\n".join(f"And so it went on, the sound of the {i} bells…"
                                  for i in range(30)),
    "ellipsis_symbols": PROSE + " ... " * 40,
    "hashes": PROSE + " #tag" * 150,
    "repeated_lines": "\n".join([PROSE_LINE] * 25 + [PROSE]),
    "repeated_paragraphs": "\n\n".join([PROSE] * 4 + ["A different closing paragraph, "
                                                      "with the last of the words."]),
    "blank_line_runs": PROSE.replace("\n", "\n\n\n\n", 3) + "\n\n\n",
    "ngram_repetition": ("the cat sat on the mat and looked at the dog. " * 30) + PROSE,
    # equal when words are concatenated ("abc"), different when joined with spaces
    "concatenation_collision": " ".join(["ab c", "a bc", "abc"] * 60) + " " + PROSE,
    "top_bigram": PROSE + " " + "New York " * 80,
    "lorem_ipsum": PROSE + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "lorem_on_a_short_line": PROSE + "\nlorem ipsum.",
    "javascript_lines": "\n".join(["Please enable JavaScript to view the comments here."] * 3
                                  + [PROSE_LINE] * 2),
    "curly_brackets": PROSE + "\nPass the options as a mapping, e.g. {'timeout': 10}.",
    "policy_lines": "\n".join(["By using this site you agree that it uses cookies for ads."] * 4
                              + [f"We read our privacy policy {i} times, and that is fine."
                                 for i in range(3)]),
    "citations": "\n".join(f"The river is {i} miles long.[{i}] It floods.[citation needed] "
                           "See the map [edit] for more." for i in range(8)),
    "citation_leaves_spaces": "\n".join(f"Hi there, friend {i}.  !b and so on. [1] [2]"
                                        for i in range(6)),
    "long_words": PROSE + "\n" + " ".join(["x" * 1200, "is", "a", "long", "word."]),
    "whitespace_variety": ("The\u00a0cat  sat.\u2003On\tthe mat.\r\nThe dog\x0bbarked, and "
                           "then\x0cit left.\x1cThe end.\u2028Again, the end.\u2029" * 12),
    "crlf": PROSE.replace("\n", "\r\n"),
    "double_spaces_after_periods": PROSE.replace(". ", ".   ").replace(",", " ,  "),
    "emoticons_and_contractions": ("It's fine :) and we can't stop :-( but that's o.O, "
                                   "don't you think? Yes I'd say so! " * 20),
    "urls_and_numbers": ("See https://example.org/a?b=c&d=1 and mail me at a.b@example.com "
                         "or call 555-0100; it costs $3.50 (20% off) on 2024-05-01. " * 15),
    "is_alpha": "IS_ALPHA " + PROSE,  # the string datatrove retokenizes without
    # blank lines count as one sentence each when C4 keeps lines of 0 words
    "blank_lines_between_sentences": "One short sentence here.\n\n\n\nAnother one, the last.\n\n",
    "numbers_table": "\n".join(" ".join(str(i * j) for j in range(10)) for i in range(40)),
    "menu": "\n".join(["Home", "About", "Contact", "Blog", "Shop"] * 8) + "\n" + PROSE,
}


def _lines(path: Path, start: int, stop: int) -> str:
    return "\n".join(path.read_text(encoding="utf-8").splitlines()[start:stop])


@pytest.fixture(scope="module")
def documents(shared_data) -> dict[str, str]:
    """Every shared WARC/JSONL page, pieces of the corpora (prose, verse, non-Latin scripts,
    word lists, Markdown) and the edge cases."""
    docs = {f"page:{url}#{i}": text for i, (text, url) in enumerate(shared_pages(shared_data))}
    corpus, sentences = shared_data / "corpus", shared_data / "multilingual" / "lingua_sentences"
    docs.update({
        "botchan": (corpus / "botchan_en.txt").read_text(encoding="utf-8")[5000:12000],
        "shakespeare": (corpus / "tinyshakespeare.txt").read_text(encoding="utf-8")[:6000],
        "genesis": (corpus / "nltk_genesis" / "english-kjv.txt").read_text()[:4000],
        "neko_ja": (corpus / "wagahaiwa_nekodearu_ja.txt").read_text(encoding="utf-8")[:3000],
        "stopwords": (shared_data / "multilingual" / "nltk_stopwords" / "english").read_text(),
        "piqa_labels": _lines(shared_data / "eval" / "piqa" / "valid-labels_part1.lst", 0, 300),
        "readme": (REPO / "README.md").read_text(encoding="utf-8")[:8000],
    })
    for code in ("ar", "de", "el", "en", "hi", "ja", "ko", "ru", "zh"):
        if (sentences / f"{code}.txt").exists():
            docs[f"sentences:{code}"] = _lines(sentences / f"{code}.txt", 0, 40)
    docs.update({f"edge:{name}": text for name, text in EDGE_CASES.items()})
    return docs


# Per rule: threshold settings (updates of the collect defaults), each of that rule's fields
# moved at least once, alone (every other check of the rule off) and on the defaults; the third
# setting of Gopher quality, FineWeb and C4 is the tiny preset's (configs/tiny.yaml).
GOPHER_QUALITY_OFF = dict(min_words=1, max_words=10**9, min_mean_word_len=0,
                          max_mean_word_len=10**6, max_symbol_word_ratio=0, max_bullet_line_frac=0,
                          max_ellipsis_line_frac=0, min_alpha_word_frac=0, min_stop_words=0)
REPETITION_OFF = dict(max_duplicate_line_frac=0, max_duplicate_para_frac=0,
                      max_duplicate_line_char_frac=0, max_duplicate_para_char_frac=0,
                      max_top_ngram_char_frac=(), max_duplicate_ngram_char_frac=())
FINEWEB_OFF = dict(fineweb_min_punct_line_frac=0, fineweb_max_short_line_frac=1,
                   fineweb_max_duplicate_line_char_frac=1, fineweb_max_newlines_per_word=10**6)
C4_OFF = dict(c4_min_sentences=0, c4_min_words_per_line=0, c4_max_word_chars=10**6,
              c4_require_terminal_punct=False, c4_drop_lorem_ipsum=False,
              c4_drop_curly_bracket=False, c4_skip_javascript_lines=False,
              c4_skip_policy_lines=False)
SETTINGS: dict[str, list[dict]] = {
    "gopher_quality": [
        {}, GOPHER_QUALITY_OFF, dict(min_alpha_word_frac=0.5),
        *({**GOPHER_QUALITY_OFF, **change} for change in (
            dict(min_words=50), dict(min_words=300), dict(max_words=100),
            dict(min_mean_word_len=3), dict(min_mean_word_len=4.5),
            dict(max_mean_word_len=0), dict(max_mean_word_len=10), dict(max_mean_word_len=4),
            dict(max_symbol_word_ratio=0.1), dict(max_symbol_word_ratio=0.005),
            dict(max_bullet_line_frac=0.9), dict(max_bullet_line_frac=0.05),
            dict(max_ellipsis_line_frac=0.3), dict(max_ellipsis_line_frac=0.02),
            dict(min_alpha_word_frac=0.5), dict(min_alpha_word_frac=0.95),
            dict(min_stop_words=2), dict(min_stop_words=8))),
    ],
    "gopher_repetition": [
        {}, REPETITION_OFF,
        *({**REPETITION_OFF, **change} for change in (
            dict(max_duplicate_para_frac=0.3), dict(max_duplicate_para_frac=0.01),
            dict(max_duplicate_para_char_frac=0.2), dict(max_duplicate_para_char_frac=0.01),
            dict(max_duplicate_line_frac=0.3), dict(max_duplicate_line_frac=0.01),
            dict(max_duplicate_line_char_frac=0.2), dict(max_duplicate_line_char_frac=0.01),
            dict(max_top_ngram_char_frac=((2, 0.2), (3, 0.18), (4, 0.16))),
            dict(max_top_ngram_char_frac=((4, 0.02), (1, 0.03), (2, 0.02))),
            dict(max_duplicate_ngram_char_frac=((5, 0.15), (10, 0.1))),
            dict(max_duplicate_ngram_char_frac=((10, 0.01), (3, 0.02), (1, 0.1), (2, 0.05))))),
    ],
    "fineweb_quality": [
        {}, FINEWEB_OFF,
        dict(fineweb_min_punct_line_frac=0.05, fineweb_max_duplicate_line_char_frac=0.1),
        *({**FINEWEB_OFF, **change} for change in (
            dict(fineweb_min_punct_line_frac=0.05), dict(fineweb_min_punct_line_frac=0.6),
            dict(fineweb_max_short_line_frac=0.67), dict(fineweb_max_short_line_frac=0.1),
            dict(fineweb_max_short_line_frac=0.3, fineweb_short_line_chars=80),
            dict(fineweb_max_short_line_frac=0, fineweb_short_line_chars=1),
            dict(fineweb_max_duplicate_line_char_frac=0.1),
            dict(fineweb_max_duplicate_line_char_frac=0),
            dict(fineweb_max_newlines_per_word=0.3), dict(fineweb_max_newlines_per_word=0.05),
            dict(fineweb_max_newlines_per_word=0))),
    ],
    "c4_quality": [
        {}, C4_OFF, dict(c4_require_terminal_punct=False, c4_drop_curly_bracket=False),
        dict(c4_drop_lorem_ipsum=False), dict(c4_skip_javascript_lines=False),
        dict(c4_skip_policy_lines=False), dict(c4_min_sentences=0), dict(c4_min_sentences=1),
        dict(c4_min_sentences=40), dict(c4_min_words_per_line=0),
        dict(c4_min_words_per_line=12), dict(c4_max_word_chars=1), dict(c4_max_word_chars=9),
        *({**C4_OFF, **change} for change in (
            dict(c4_min_sentences=5), dict(c4_min_sentences=20, c4_min_words_per_line=3),
            dict(c4_min_sentences=10, c4_require_terminal_punct=True),
            dict(c4_drop_lorem_ipsum=True), dict(c4_drop_curly_bracket=True),
            dict(c4_min_sentences=8, c4_skip_javascript_lines=True),
            dict(c4_min_sentences=8, c4_skip_policy_lines=True),
            dict(c4_min_sentences=8, c4_max_word_chars=1000))),
    ],
}
EVERY_REASON = {
    "gopher_quality": {
        None, "gopher_short_doc", "gopher_long_doc", "gopher_below_avg_threshold",
        "gopher_above_avg_threshold", "gopher_too_many_hashes", "gopher_too_many_ellipsis",
        "gopher_too_many_bullets", "gopher_too_many_end_ellipsis",
        "gopher_below_alpha_threshold", "gopher_enough_stop_words"},
    "gopher_repetition": {
        None, "empty", "dup_para_frac", "dup_para_char_frac", "dup_line_frac",
        "dup_line_char_frac", "top_1_gram", "top_2_gram", "top_4_gram",
        "duplicated_1_n_grams", "duplicated_3_n_grams", "duplicated_5_n_grams",
        "duplicated_10_n_grams"},
    "fineweb_quality": {None, "empty", "line_punct_ratio", "short_line_ratio", "char_dup_ratio",
                        "list_ratio"},
    "c4_quality": {None, "lorem_ipsum", "curly_bracket", "too_few_sentences"},
}


@pytest.fixture
def memoized_datatrove(monkeypatch):
    """datatrove's own word and sentence splitters, memoized without bound inside its blocks for
    this test, so the many settings do not tokenize the same text again (results unchanged)."""
    for module, name in ((gopher_quality_filter, "split_into_words"),
                         (gopher_repetition_filter, "split_into_words"),
                         (fineweb_quality_filter, "split_into_words"),
                         (c4_filters, "split_into_sentences")):
        monkeypatch.setattr(module, name, functools.lru_cache(maxsize=None)(getattr(module, name)))


def _datatrove_reason(kind: str, text: str, cfg) -> str | None:
    verdict = text_filters.block_for(kind, cfg).filter(Document(text=text, id=""))
    return None if verdict is True else verdict[1]


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_rules_decide_as_datatrove(kind, documents, memoized_datatrove):
    configs = [collect.Config(**{**CFG.model_dump(), **update}) for update in SETTINGS[kind]]
    rule = getattr(rules, kind)
    differ, seen = [], set()
    for name, text in documents.items():
        page = rules.Page(text)  # shared by every setting, as the chain shares it by the rules
        for cfg, update in zip(configs, SETTINGS[kind]):
            ours, theirs = rule(page, cfg), _datatrove_reason(kind, text, cfg)
            seen.add(theirs)
            if ours != theirs:
                differ.append(f"{name} {update}: ours {ours}, datatrove {theirs}")
    assert not differ, f"{len(differ)} decisions differ:\n" + "\n".join(differ[:20])
    # The documents reach every reason (and keeps), so every check was compared.
    assert seen >= EVERY_REASON[kind], EVERY_REASON[kind] - seen


def test_filters_prefix_the_reasons_of_the_rules():
    assert text_filters.c4_quality(EDGE_CASES["lorem_ipsum"], CFG) == "c4_lorem_ipsum"
    assert text_filters.fineweb_quality("", CFG) == "fineweb_empty"
    assert text_filters.gopher_repetition("", CFG) == "empty"  # datatrove's, unprefixed
    assert text_filters.gopher_quality(rules.Page(""), CFG) == "gopher_short_doc"


def test_split_words_and_sentences_match_datatrove(documents):
    for name, text in documents.items():
        assert rules.split_words(text) == split_into_words(text), name
    for line in [*list(EDGE_CASES.values())[:12], "", "Hi.  !b", "a. [1] [2] ", " x. y",
                 "IS_ALPHA. is here", "(IS_ALPHA) too."]:
        assert rules.sentence_count(line) == len(split_into_sentences(line)), line


def test_word_caches_stay_bounded_and_exact(documents, monkeypatch):
    monkeypatch.setattr(rules, "_chunks", {})
    monkeypatch.setattr(rules, "MAX_CACHED_CHUNKS", 50)
    monkeypatch.setattr(rules, "MAX_LEXEMES", 1500)  # a fresh blank("en") holds ~800
    first = rules._spacy()
    for text in list(documents.values())[:6]:
        assert rules.split_words(text) == split_into_words(text)
        assert len(rules._chunks) <= max(50, len(set(text.split())))
    assert rules._spacy() is not first  # rebuilt past MAX_LEXEMES


# Letters, digits, punctuation, every kind of whitespace, non-Latin scripts and the pieces
# spaCy has special cases or rules for, strung together.
_TEXT = st.lists(
    st.sampled_from([*"abcXYZ019 .,;:!?'\"()[]{}-–—…•#@/$%&*<>\n\t\r\u00a0\u2003éßжカ文😀",
                     "n't", "'s", ":)", "o.O", "e.g.", "U.S.", "http://a.io/x", "IS_ALPHA",
                     "[1]", "...", "  ", "lorem ipsum", "{"]),
    max_size=80).map("".join)


@settings(max_examples=300, deadline=None)
@given(_TEXT)
@example("IS_ALPHA.")
@example("a:) )")  # a special case (":))") met across a space
def test_fuzzed_text_splits_as_datatrove(text):
    assert rules.split_words(text) == split_into_words(text)
    assert rules.sentence_count(text.strip()) == len(split_into_sentences(text.strip()))
    for kind in ("gopher_quality", "gopher_repetition", "fineweb_quality", "c4_quality"):
        assert getattr(rules, kind)(rules.Page(text), CFG) == _datatrove_reason(kind, text, CFG)
