"""collect+clean: filters, readers on real WARC/JSONL files, robustness, the stage, the demo."""
from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

import pydantic
import pytest
from collect_helpers import TINY_CLEANING

import gristmill.tasks.collect.clean.filters as text_filters
import gristmill.tasks.collect.read.demo_crawl as demo_crawl
import gristmill.tasks.collect.stage as collect
from gristmill.core.stage import InputError, SerialEngine
from gristmill.tasks.collect.clean.cleaning import clean_document
from gristmill.tasks.collect.config import fingerprint
from gristmill.tasks.collect.read.readers import (
    RawDoc,
    Skipped,
    extract_text,
    read_file,
    resolve_source,
)

CFG = collect.Config()


class ReverseEngine:
    """Runs items last-to-first (as a parallel engine may finish them), returns them in order."""

    def map(self, fn, items):
        return [fn(item) for item in reversed(items)][::-1]


def _events(path: Path) -> tuple[Counter, list[RawDoc]]:
    reasons, docs = Counter(), []
    for event in read_file(path):
        if isinstance(event, Skipped):
            reasons[event.reason] += 1
        else:
            docs.append(event)
    return reasons, docs


def _read_docs(out_dir: Path) -> list[dict]:
    docs = []
    for part in sorted((out_dir / "docs").glob("part-*.jsonl.gz")):
        with gzip.open(part, "rt", encoding="utf-8") as f:
            docs += [json.loads(line) for line in f]
    return docs


def _run(tmp_path: Path, name: str, engine=None, **config) -> tuple[collect.StageResult, Path]:
    out = tmp_path / name
    out.mkdir()
    result = collect.run(collect.Config(**config), out, engine=engine or SerialEngine())
    return result, out


@pytest.fixture(scope="module")
def prose(shared_data) -> str:
    """Real English prose: the translator's note of Botchan (Gutenberg)."""
    lines = (shared_data / "corpus" / "botchan_en.txt").read_text(encoding="utf-8").splitlines()
    start = lines.index("A NOTE BY THE TRANSLATOR")
    return "\n".join(lines[start + 1 : start + 40])


# --- filters (datatrove's Gopher blocks; reasons are datatrove's own) -----------------------

def _lines(path: Path, start: int, stop: int) -> str:
    return "\n".join(path.read_text(encoding="utf-8").splitlines()[start:stop])


def _jsonl_text(path: Path, index: int) -> str:
    return json.loads(path.read_text(encoding="utf-8").splitlines()[index])["text"]


def test_prose_passes_the_gopher_filters(prose, shared_data):
    assert len(prose.split()) > 200
    web_page = _jsonl_text(shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0091.jsonl", 0)
    for text in (prose, web_page):
        for text_filter in (text_filters.gopher_quality, text_filters.gopher_repetition):
            assert text_filter(text, CFG) is None, text_filter.__name__


def test_gopher_quality_drops(prose, shared_data):
    quality = text_filters.gopher_quality
    assert quality(" ".join(prose.split()[:30]), CFG) == "gopher_short_doc"
    german = _lines(shared_data / "multilingual" / "lingua_sentences" / "de.txt", 0, 20)
    assert quality(german, CFG) == "gopher_enough_stop_words"  # English stop words only
    labels = _lines(shared_data / "eval" / "piqa" / "valid-labels_part1.lst", 0, 400)
    assert quality(labels, CFG) == "gopher_below_avg_threshold"  # "0"/"1" per line
    teasers = _jsonl_text(shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0174.jsonl", 5)
    assert quality(teasers, CFG) == "gopher_too_many_end_ellipsis"


def test_gopher_quality_thresholds_reach_datatrove(prose):
    quality = text_filters.gopher_quality
    cases = {"max_words": (100, "gopher_long_doc"),
             "max_mean_word_len": (3.5, "gopher_above_avg_threshold"),
             "min_alpha_word_frac": (0.95, "gopher_below_alpha_threshold")}  # prose: ~0.9
    for field, (value, reason) in cases.items():
        assert quality(prose, CFG.model_copy(update={field: value})) == reason, field
    hashes = prose + " #tag" * 150  # spaCy splits "#tag" into 2 tokens
    assert quality(hashes, CFG) == "gopher_too_many_hashes"
    lenient = CFG.model_copy(update={"max_symbol_word_ratio": 0.5})
    assert quality(hashes, lenient) == "gopher_below_alpha_threshold"  # 150 "#": under Gopher's 0.8
    assert quality(hashes, lenient.model_copy(update={"min_alpha_word_frac": 0.5})) is None


def test_gopher_repetition(shared_data):
    repetition = text_filters.gopher_repetition
    shakespeare = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[:10_000]
    assert repetition(shakespeare, CFG) is None
    genesis = (shared_data / "corpus" / "nltk_genesis" / "english-kjv.txt").read_text()[:4000]
    assert repetition(genesis, CFG) == "duplicated_5_n_grams"  # "And God said, Let there be"
    lenient = CFG.model_copy(update={"max_duplicate_ngram_char_frac": ((5, 0.9),)})
    assert repetition(genesis, lenient) is None
    labels = _lines(shared_data / "eval" / "piqa" / "valid-labels_part1.lst", 0, 400)
    assert repetition(labels, CFG) == "dup_line_frac"
    vocab = _lines(shared_data / "tokenizer" / "rwkv_vocab_v20230424.txt", 1000, 1100)
    assert repetition(vocab, CFG) == "top_2_gram"


def test_first_reason_wins(shared_data):
    # Rejected by both filters: quality runs first, so its reason is the one counted.
    labels = _lines(shared_data / "eval" / "piqa" / "valid-labels_part1.lst", 0, 400)
    assert clean_document(labels, "", CFG).reason == "language_score_low"  # language ID is earlier
    any_language = CFG.model_copy(update={"allowed_languages": None, "min_language_score": 0.0})
    assert clean_document(labels, "", any_language).reason == "gopher_below_avg_threshold"


def test_blocks_built_once_per_threshold_set():
    block = text_filters.block_for("gopher_quality", CFG)
    assert text_filters.block_for("gopher_quality", collect.Config(num_workers=7)) is block
    stricter = text_filters.block_for("gopher_quality", collect.Config(min_words=80))
    assert stricter is not block and stricter.min_doc_words == 80
    repetition = text_filters.block_for("gopher_repetition", CFG)
    assert repetition.dup_n_grams == CFG.max_duplicate_ngram_char_frac


# --- readers on real files -----------------------------------------------------------------

def test_whirlwind_warc_and_wet(shared_data):
    folder = shared_data / "warc" / "commoncrawl_whirlwind"
    reasons, docs = _events(folder / "whirlwind.warc.gz")
    assert reasons == {"skipped_record_warcinfo": 1, "skipped_record_request": 1,
                       "skipped_record_metadata": 1}
    assert [d.url for d in docs] == ["https://an.wikipedia.org/wiki/Escopete"] and docs[0].is_html
    text = extract_text(docs[0])
    assert "Guerra Civil" in text and "Menú principal" not in text  # body kept, menu dropped
    reasons, docs = _events(folder / "whirlwind.warc.wet.gz")
    assert reasons == {"skipped_record_warcinfo": 1}
    assert len(docs) == 1 and not docs[0].is_html
    assert extract_text(docs[0]).startswith("Escopete - Biquipedia")


def test_dolma_wget_warc(shared_data):
    reasons, docs = _events(shared_data / "warc" / "dolma_wget" / "sample-0000.warc.gz")
    assert reasons["skipped_record_request"] == 22 and reasons["skipped_record_resource"] == 2
    assert len(docs) == 22 and all(d.is_html and d.url.startswith("http") for d in docs)


def test_sopa_wikipedia_skips_non_html(shared_data):
    folder = shared_data / "warc" / "ukwa_test_suite"
    reasons, docs = _events(folder / "sopa-wikipedia-homepage.warc.gz")
    assert reasons["skipped_mime_image"] == 58
    assert reasons["skipped_mime_javascript"] == 11
    assert reasons["skipped_mime_css"] == 2
    assert reasons["skipped_record_request"] == 86
    html = [d for d in docs if d.is_html]
    assert [d.url for d in html] == ["http://en.wikipedia.org/wiki/Main_Page"]


def test_ukwa_redirects_and_dns(shared_data):
    folder = shared_data / "warc" / "ukwa_test_suite"
    assert _events(folder / "IAH-urls-wget.warc.gz")[0]["skipped_http_3xx"] == 9
    reasons, _ = _events(folder / "IAH-20080430204825-00000-blackbook-truncated.warc.gz")
    assert reasons["skipped_mime_dns"] == 1 and reasons["skipped_record_metadata"] == 7


def test_warcio_examples(shared_data):
    folder = shared_data / "warc" / "warcio_examples"
    reasons, docs = _events(folder / "example.warc.gz")
    assert reasons["skipped_record_revisit"] == 1
    assert [d.url for d in docs] == ["http://example.com/"]
    assert extract_text(docs[0]).startswith("This domain is established to be used for")
    reasons, docs = _events(folder / "example-digest.warc")  # uncompressed, requests only
    assert reasons == {"skipped_record_request": 4} and docs == []


def test_dolma_jsonl(shared_data):
    folder = shared_data / "jsonl" / "dolma_cc"
    reasons, docs = _events(folder / "cc_en_head-0091.jsonl")
    assert not reasons and len(docs) == 10
    assert docs[0].url == ("http://100kinvesting.com/2016/11/28/"
                           "first-teleconference-calls-invoice-factoring/")
    reasons, docs = _events(folder / "documents-000.json.gz")
    assert not reasons and len(docs) == 10
    # metadata.url wins over the id (here they differ)
    assert docs[0].url == "http://advocatesaz.org/tag/good-cholesterol/"


# --- robustness ----------------------------------------------------------------------------

def test_truncated_warc_gz(shared_data, tmp_path):
    data = (shared_data / "warc" / "dolma_wget" / "sample-0000.warc.gz").read_bytes()
    cut = tmp_path / "cut.warc.gz"
    cut.write_bytes(data[: len(data) // 2])
    reasons, docs = _events(cut)
    assert reasons["error_truncated_record"] == 1
    assert 5 < len(docs) < 22  # the records before the cut are still read


def test_bad_jsonl_lines(shared_data, tmp_path):
    good = (shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0091.jsonl").read_bytes()
    lines = [b"this is not json", b'{"text": "caf\xe9 \xff"}', b'{"id": 1}', good.splitlines()[0]]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    reasons, docs = _events(bad)
    assert reasons == {"error_bad_json": 1, "error_invalid_utf8": 1, "error_missing_text": 1}
    assert len(docs) == 1


def test_truncated_jsonl_gz(shared_data, tmp_path):
    original = shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0091.jsonl"
    data = gzip.compress(original.read_bytes())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    reasons, docs = _events(cut)
    assert reasons == {"error_truncated_gzip": 1} and 0 < len(docs) < 10


def test_stage_survives_bad_inputs(shared_data, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "empty.jsonl").write_bytes(b"")
    (inputs / "garbage.warc").write_bytes(b"hello, this is not a web archive\n" * 5)
    data = (shared_data / "warc" / "dolma_wget" / "sample-0001.warc.gz").read_bytes()
    (inputs / "cut.warc.gz").write_bytes(data[: len(data) // 2])
    (inputs / "bad.jsonl").write_bytes(b"{oops\n")
    shutil.copy(shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0174.jsonl", inputs)
    result, out = _run(tmp_path, "out", sources=[str(inputs)])
    stats = result.stats
    assert stats["error_empty_file"] == 1 and stats["error_not_warc"] == 1
    assert stats["error_truncated_record"] == 1 and stats["error_bad_json"] == 1
    assert stats["docs_out"] > 10 and len(_read_docs(out)) == stats["docs_out"]
    accounting = json.loads((out / "funnel.json").read_text())["accounting"]
    assert accounting["balanced"] and accounting["kept"] == stats["docs_out"]
    assert accounting["quarantined"] == {"error_bad_json": 1, "error_truncated_record": 1}
    assert accounting["file_level"] == {"error_empty_file": 1, "error_not_warc": 1}
    assert stats["accounting_in"] == stats["records_read"] == accounting["in"] == stats["docs_out"] \
        + stats["accounting_dropped"] + stats["accounting_quarantined"]
    # the funnel report (Prefect artifact `collect-funnel`) leads with the same accounting
    from gristmill.flows.reports import funnel_markdown

    report = funnel_markdown(json.loads((out / "funnel.json").read_text()))
    assert report.startswith(f"**Records:** {accounting['summary']}\n")
    assert "error_bad_json 1, error_truncated_record 1 |" in report


def test_missing_or_empty_source_names_it(shared_data, tmp_path):
    missing = str(tmp_path / "nowhere" / "*.warc.gz")
    with pytest.raises(ValueError, match="nowhere"):
        _run(tmp_path, "a", sources=[missing])
    requests_only = str(shared_data / "warc" / "warcio_examples" / "example-digest.warc")
    no_document = r"no source yielded a document: .*example-digest\.warc.*skipped_record"
    with pytest.raises(InputError, match=no_document):  # the user's data: one line, exit 2 (flows/supervised.py)
        _run(tmp_path, "b", sources=[requests_only])
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(InputError, match=r"^no source yielded a document: '.*garbage\.jsonl' \(error_"):
        _run(tmp_path, "b2", sources=[str(garbage)])
    with pytest.raises(ValueError, match="demo:nothing"):
        _run(tmp_path, "c", sources=["demo:nothing"])


# --- the stage -----------------------------------------------------------------------------

def test_stage_on_warc_and_jsonl(shared_data, tmp_path):
    sources = [str(shared_data / "warc" / "ukwa_test_suite"),
               str(shared_data / "jsonl" / "dolma_cc" / "*.jsonl")]
    result, out = _run(tmp_path, "out", sources=sources)
    docs, stats = _read_docs(out), result.stats
    assert len(docs) == stats["docs_out"] > 10  # 15 of 29 pass the published thresholds
    assert set(docs[0]) == {"id", "text", "source", "url", "language"}
    assert len({collect.text_hash(d["text"]) for d in docs}) == len(docs)
    assert len({d["id"] for d in docs}) == len(docs)
    assert {d["source"] for d in docs} == set(sources)
    assert stats["skipped_mime_image"] > 0 and stats["skipped_record_request"] > 0
    assert stats["docs_in"] == stats["docs_after_quality_heuristics"] + sum(
        v for k, v in stats.items() if k.startswith("dropped_"))
    assert stats["docs_out"] == stats["docs_after_quality_heuristics"] - stats["exact_duplicates"] \
        - stats["near_duplicates"]
    assert stats["bytes_out"] == sum(len(d["text"].encode()) for d in docs)
    funnel = json.loads((out / "funnel.json").read_text())
    steps = [s["step"] for s in funnel["steps"]]
    assert steps == ["records_read", "extracted", "url_filter", "language", "quality_heuristics",
                     "exact_dedup", "near_dedup", "mix"]
    assert funnel["steps"][-1]["docs"] == stats["docs_out"]
    assert all(a["docs"] >= b["docs"] for a, b in zip(funnel["steps"][1:], funnel["steps"][2:]))
    assert set(result.artifacts) >= {"funnel.json", "mix.json", "review/dropped.jsonl"}
    assert funnel["dropped"] == {k: v for k, v in stats.items() if k.startswith("dropped_")}
    assert funnel["languages"]["en"] >= stats["docs_out"]
    review = [json.loads(line) for line in (out / "review" / "dropped.jsonl").open()]
    assert {r["reason"] for r in review} == set(funnel["dropped"])
    assert all(r["preview"] for r in review)
    assert not (out / "units").exists()  # resume state is gone once the stage is done
    accounting = funnel["accounting"]  # every record read: kept, dropped with a reason, quarantined
    assert accounting["balanced"] and accounting["in"] == stats["records_read"]
    assert accounting["kept"] == len(docs) and accounting["quarantined"] == {}
    assert accounting["dropped"]["skipped_mime_image"] == stats["skipped_mime_image"]
    assert accounting["in"] == len(docs) + sum(accounting["dropped"].values())


def test_duplicate_file_is_deduplicated(shared_data, tmp_path):
    original = shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0091.jsonl"
    copy = tmp_path / "copy.jsonl"
    shutil.copy(original, copy)
    single, _ = _run(tmp_path, "single", sources=[str(original)])
    result, out = _run(tmp_path, "twice", sources=[str(original), str(copy)])
    assert result.stats["exact_duplicates"] == single.stats["docs_out"] > 0
    docs = _read_docs(out)
    assert len(docs) == single.stats["docs_out"]
    assert {d["source"] for d in docs} == {str(original)}  # first occurrence wins


def test_output_independent_of_engine_and_workers(shared_data, tmp_path):
    warc = shared_data / "warc"
    sources = [str(warc / "warcio_examples"), str(warc / "ukwa_test_suite"),
               str(shared_data / "jsonl" / "dolma_cc")]
    a, out_a = _run(tmp_path, "a", sources=sources, num_workers=1, docs_per_shard=10)
    b, out_b = _run(tmp_path, "b", ReverseEngine(), sources=sources, num_workers=4,
                    docs_per_shard=10)
    _, out_c = _run(tmp_path, "c", ReverseEngine(), sources=sources, docs_per_shard=7)
    assert a.stats == b.stats
    parts = sorted(p.name for p in (out_a / "docs").iterdir())
    assert len(parts) == -(-a.stats["docs_out"] // 10) > 1
    for part in parts:  # byte-identical shards
        assert (out_a / "docs" / part).read_bytes() == (out_b / "docs" / part).read_bytes()
    assert _read_docs(out_a) == _read_docs(out_c)


def test_max_docs_per_source(shared_data, tmp_path):
    result, out = _run(tmp_path, "out", sources=[str(shared_data / "jsonl" / "dolma_cc")],
                       max_docs_per_source=15)
    assert result.stats["docs_in"] == 15 and result.stats["records_read"] == 15
    assert len(_read_docs(out)) == result.stats["docs_out"] <= 15


def test_config_validation_and_hashing():
    with pytest.raises(pydantic.ValidationError, match="max_words"):
        collect.Config(min_words=100, max_words=10)
    with pytest.raises(pydantic.ValidationError, match="min_word"):
        collect.Config(min_word=3)
    with pytest.raises(pydantic.ValidationError, match="docs_per_shard"):
        collect.Config(docs_per_shard=0)
    with pytest.raises(pydantic.ValidationError, match="max_top_ngram_char_frac"):
        collect.Config(max_top_ngram_char_frac=[[0, 0.2]])
    from_yaml = collect.Config(max_duplicate_ngram_char_frac=[[5, 0.2]])  # lists, as YAML gives
    assert from_yaml.max_duplicate_ngram_char_frac == ((5, 0.2),)
    mapped = {**text_filters.GOPHER_QUALITY_ARGS, **text_filters.GOPHER_REPETITION_ARGS}
    assert set(mapped) <= set(collect.Config.model_fields)
    assert "num_workers" not in CFG.hashed_dict() and "min_words" in CFG.hashed_dict()
    assert all(f.description for f in collect.Config.model_fields.values())


def test_fingerprint_follows_file_content(shared_data, tmp_path):
    path = tmp_path / "docs.jsonl"
    shutil.copy(shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0174.jsonl", path)
    config = collect.Config(sources=[str(tmp_path)])
    first = fingerprint(config)
    assert fingerprint(config) == first
    path.write_bytes(path.read_bytes() + b'{"text": "one more"}\n')
    assert fingerprint(config) != first
    assert fingerprint(CFG) == fingerprint(collect.Config())
    assert resolve_source(str(tmp_path)) == [path]


def test_sources_of_only_empty_files_are_refused_when_the_run_is_planned(shared_data, tmp_path):
    """Nothing to read in any source is known from the listings; one empty source among others
    is quarantined when the stage runs (test_collect_corpus.py) while the others go on."""
    import fsspec

    (tmp_path / "crawl").mkdir()
    for name in ("a.warc.gz", "b.jsonl"):
        (tmp_path / "crawl" / name).write_bytes(b"")
    empty_url = f"memory://empty-{tmp_path.name}/x.jsonl"  # an object store's listing gives sizes too
    fsspec.filesystem("memory").pipe(empty_url, b"")
    try:
        for sources in ([str(tmp_path / "crawl")], [str(tmp_path / "crawl" / "b.jsonl"), empty_url]):
            with pytest.raises(ValueError, match=r"^collect\.sources: nothing to read, every input file of "
                                                 rf"{', '.join(map(repr, sources))} is empty \(0 bytes\)$"):
                fingerprint(collect.Config(sources=sources))
        good = str(shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0174.jsonl")
        assert fingerprint(collect.Config(sources=[str(tmp_path / "crawl"), empty_url, good]))
    finally:
        fsspec.filesystem("memory").rm(empty_url)


# --- the demo crawl ------------------------------------------------------------------------

def test_demo_plan_covers_every_package_once():
    packages = demo_crawl.list_packages()
    for workers in (1, 3):
        units = collect.plan_units(collect.Config(num_workers=workers), Path("downloads"))
        assert [p for u in units for p in u.packages] == packages
    n_units = len(collect.plan_units(collect.Config(num_workers=3), Path("downloads")))
    assert n_units == 3 * collect.DEMO_CHUNKS_PER_WORKER


def test_demo_records():
    events = list(demo_crawl.iter_records(demo_crawl.list_packages()))
    docs = [e for e in events if isinstance(e, RawDoc)]
    assert len(docs) > 100
    assert all(d.url.startswith("python-package://") for d in docs)
    assert any(d.url.endswith("/METADATA") and "pydantic" in d.url for d in docs)
    assert any(d.is_html for d in docs)  # the HTML extraction path runs in the demo too


def test_demo_stage_capped(tmp_path):
    result, out = _run(tmp_path, "out", max_docs_per_source=20, num_workers=1, **TINY_CLEANING)
    docs = _read_docs(out)
    assert result.stats["docs_in"] == 20
    assert len(docs) == result.stats["docs_out"] >= 10  # README-style docs mostly pass
    assert all(d["source"] == demo_crawl.DEMO_SOURCE for d in docs)


@pytest.mark.slow
def test_demo_stage_keeps_enough_text(tmp_path):
    # The tiny pipeline trains its tokenizer and model on this: it needs >~1 MB of text.
    result, out = _run(tmp_path, "out", **TINY_CLEANING)
    docs = _read_docs(out)
    assert len(docs) == result.stats["docs_out"] > 150
    assert result.stats["bytes_out"] > 1_000_000
    assert all(d["source"] == demo_crawl.DEMO_SOURCE for d in docs)


def test_missing_extractor_dependency_fails_loudly(shared_data, tmp_path, monkeypatch):
    """A broken install (e.g. lxml without its HTML cleaner) must not be counted page by page as
    bad input: the stage stops with the ImportError."""
    def broken(_doc):
        raise ImportError("lxml.html.clean module is now a separate project lxml_html_clean")

    monkeypatch.setattr(collect, "extract_text", broken)
    config = collect.Config(sources=[str(shared_data / "warc" / "warcio_examples")])
    with pytest.raises(ImportError, match="lxml_html_clean"):
        collect.run(config, tmp_path / "out", engine=SerialEngine())
