"""collect+clean at corpus level: resume of unfinished units, near dedup across sources and
against an earlier run's index, decontamination, mixing, the quality model, quarantine and
review samples, the accounting of every record read, and a Common Crawl source served over
HTTP."""
from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from collect_helpers import spooled_table
from corpus_helpers import CRAWL, edited, web_documents, write_jsonl

import gristmill.tasks.collect.stage as collect
from gristmill.core.stage import SerialEngine
from gristmill.tasks.collect.clean.quality_model import QualityModel
from gristmill.tasks.collect.config import fingerprint
from gristmill.tasks.collect.output.funnel import AccountingError
from gristmill.tasks.collect.read.readers import FILE_LEVEL_ERRORS, read_file

DOLMA = Path("jsonl") / "dolma_cc"


def _run(out: Path, engine=None, **config) -> collect.StageResult:
    out.mkdir(parents=True, exist_ok=True)
    return collect.run(collect.Config(**config), out, engine=engine or SerialEngine())


def _docs(out: Path) -> list[dict]:
    return [json.loads(line) for part in sorted((out / "docs").iterdir())
            for line in gzip.open(part, "rt")]


def _review(out: Path, name: str = "dropped.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / "review" / name).open()]


def _accounting(out: Path, stats: dict) -> dict:
    """funnel.json's accounting, checked against what the run wrote: kept is the distinct output
    documents of each source, in the records read, dropped and quarantined hold every
    record-level reason and corpus-level removal the stats count, and in = kept + dropped +
    quarantined, in total and per source."""
    accounting = json.loads((out / "funnel.json").read_text())["accounting"]
    docs = _docs(out)
    kept = Counter(source for source, _ in {(d["source"], d["id"]) for d in docs})
    assert {s: b["kept"] for s, b in accounting["per_source"].items() if b["kept"]} == kept
    assert accounting["kept"] == kept.total() and accounting["docs_out"] == len(docs)
    assert accounting["in"] == stats["records_read"]
    counted = {k: v for k, v in stats.items() if v and (
        k.startswith(("dropped_", "skipped_", "error_")) or k in ("exact_duplicates", "near_duplicates"))
        and k not in FILE_LEVEL_ERRORS and k != "error_source_without_documents"}
    fates = Counter(accounting["dropped"]) + Counter(accounting["quarantined"])
    assert fates == counted
    assert accounting["in"] == kept.total() + fates.total()
    for block in [accounting, *accounting["per_source"].values()]:
        assert block["balanced"] and block["unaccounted"] == 0
        assert block["in"] == block["kept"] + sum(block["dropped"].values()) \
            + sum(block["quarantined"].values())
    return accounting








class FailingEngine:
    """Runs the first `n` items, then dies as a killed worker would."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def map(self, fn, items):
        for item in items[: self.n]:
            fn(item)
            self.calls += 1
        raise RuntimeError("worker killed")


class CountingEngine(SerialEngine):
    def __init__(self):
        self.items = []

    def map(self, fn, items):
        self.items += list(items)
        return super().map(fn, items)


def test_killed_stage_redoes_only_unfinished_units(shared_data, tmp_path):
    sources = [str(shared_data / "warc" / "ukwa_test_suite"), str(shared_data / DOLMA)]
    n_units = len(collect.plan_units(collect.Config(sources=sources), tmp_path))
    with pytest.raises(RuntimeError, match="killed"):
        _run(tmp_path / "out", FailingEngine(2), sources=sources)
    assert len(list((tmp_path / "out" / "units").glob("unit-*.jsonl.gz"))) == 2
    counting = CountingEngine()
    resumed = _run(tmp_path / "out", counting, sources=sources)
    unit_jobs = [job for job in counting.items if isinstance(job, tuple)
                 and isinstance(job[0], collect.WorkUnit)]
    assert len(unit_jobs) == n_units - 2
    fresh = _run(tmp_path / "fresh", sources=sources)
    assert resumed.stats == fresh.stats
    assert _accounting(tmp_path / "out", resumed.stats) == _accounting(tmp_path / "fresh", fresh.stats)
    assert _docs(tmp_path / "out") == _docs(tmp_path / "fresh")


def test_near_duplicates_across_sources_keep_the_first(shared_data, tmp_path):
    originals = web_documents(shared_data, 6)
    a = write_jsonl(tmp_path / "a.jsonl", originals)
    b = write_jsonl(tmp_path / "b.jsonl", [edited(t) for t in originals[:3]])
    result = _run(tmp_path / "out", sources=[str(a), str(b)])
    docs = _docs(tmp_path / "out")
    assert result.stats["near_duplicates"] == 3 and len(docs) == 6
    accounting = _accounting(tmp_path / "out", result.stats)
    assert accounting["per_source"][str(b)]["dropped"] == {"near_duplicates": 3}
    assert accounting["per_source"][str(b)]["kept"] == 0 and accounting["kept"] == 6
    assert {d["source"] for d in docs} == {str(a)}
    removed = [r for r in _review(tmp_path / "out") if r["reason"] == "near_duplicates"]
    assert {r["duplicate_of"] for r in removed} <= {d["id"] for d in docs}


def test_refresh_against_an_earlier_index(shared_data, tmp_path):
    originals = web_documents(shared_data, 8)
    old = write_jsonl(tmp_path / "old.jsonl", originals[:5])
    _run(tmp_path / "first", sources=[str(old)])
    new = write_jsonl(tmp_path / "new.jsonl", [edited(originals[1]), *originals[5:]])
    refreshed = _run(tmp_path / "second", sources=[str(new)],
                     dedup_index_from=str(tmp_path / "first"))
    assert refreshed.stats["near_dedup_removed_by_index"] == 1
    assert len(_docs(tmp_path / "second")) == 3
    config = collect.Config(sources=[str(new)], dedup_index_from=str(tmp_path / "first"))
    before = fingerprint(config)
    index_file = next(p for p in sorted((tmp_path / "first" / "dedup_index").iterdir()) if p.is_file())
    index_file.write_bytes(index_file.read_bytes() + b"\0")
    assert fingerprint(config) != before  # the index is an input
    shutil.rmtree(tmp_path / "first" / "dedup_index")
    (tmp_path / "first" / "dedup_index").mkdir()
    with pytest.raises(ValueError, match=r"dedup_index.*holds no input files"):
        fingerprint(config)  # found when the run is planned, not mid-run


def test_decontamination_removes_benchmark_text_and_reports_it(shared_data, tmp_path):
    gsm8k = shared_data / "eval" / "gsm8k"
    item = json.loads(next(gsm8k.glob("*.jsonl")).open().readline())
    originals = web_documents(shared_data, 4)
    leaked = originals[0] + "\n\nPractice problem: " + item["question"] + "\n" + originals[1][:400]
    path = write_jsonl(tmp_path / "docs.jsonl", [leaked, *originals[2:], leaked])
    result = _run(tmp_path / "out", sources=[str(path)],
                  decontam={"eval_sets": [str(gsm8k)]}, near_dedup=False)
    # checked in the work units, before exact dedup: both copies are contamination
    assert result.stats["dropped_benchmark_contamination"] == 2 and result.stats["exact_duplicates"] == 0
    assert len(_docs(tmp_path / "out")) == 2
    assert _accounting(tmp_path / "out", result.stats)["dropped"] == \
        {"dropped_benchmark_contamination": 2}
    funnel = json.loads((tmp_path / "out" / "funnel.json").read_text())
    assert [s["step"] for s in funnel["steps"]][-4:] == ["quality_heuristics", "decontamination", "exact_dedup", "mix"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "review" / "dropped.jsonl").open()]
    leaks = [r for r in rows if r["reason"] == "dropped_benchmark_contamination"]
    assert len(leaks) == 2 and all(m[0] == "gsm8k" for r in leaks for m in r["matches"])
    report = json.loads((tmp_path / "out" / "decontamination.json").read_text())
    assert report["documents_checked"] == 4 and report["documents_flagged"] == 1  # one text, twice
    gsm = next(b for name, b in report["benchmarks"].items() if "gsm8k" in name)
    assert gsm["items_found"] == 1 and len(gsm["found"]) == 1


def test_mix_weights_repeat_and_subsample_sources(shared_data, tmp_path):
    originals = web_documents(shared_data, 10)
    a = write_jsonl(tmp_path / "a.jsonl", originals[:4])
    b = write_jsonl(tmp_path / "b.jsonl", originals[4:])
    result = _run(tmp_path / "out", sources=[str(a), str(b)],
                  mix={"weights": {str(a): 2.0, str(b): 0.0}})
    docs = _docs(tmp_path / "out")
    assert len(docs) == 8 == result.stats["docs_out"] and {d["source"] for d in docs} == {str(a)}
    record = json.loads((tmp_path / "out" / "mix.json").read_text())
    assert record["sources"][str(a)]["docs_taken"] == 8
    assert record["sources"][str(b)]["docs_taken"] == 0 and record["docs"] == 8
    accounting = _accounting(tmp_path / "out", result.stats)  # a repeat is one document kept
    assert (accounting["in"], accounting["kept"], accounting["docs_out"]) == (10, 4, 8)
    assert accounting["dropped"] == {"dropped_not_in_mix": 6}
    with pytest.raises(ValueError, match="nope"):
        _run(tmp_path / "bad", sources=[str(a)], mix={"weights": {"nope": 1.0}})


def test_quality_model_drops_low_scores_and_is_saved(shared_data, tmp_path):
    sources = [str(shared_data / "warc"), str(shared_data / DOLMA)]
    reference = [str(shared_data / "corpus" / "nltk_inaugural")]
    result = _run(tmp_path / "out", sources=sources, near_dedup=False,
                  quality={"enabled": True, "reference": reference, "threshold": 0.5})
    stats = result.stats
    assert stats["quality_model_heldout_auc"] > 0.9
    assert stats["dropped_low_quality_score"] > 0
    assert stats["docs_out"] == stats["docs_after_exact_dedup"] - stats["dropped_low_quality_score"]
    assert (tmp_path / "out" / "quality_model" / "quality_model.npz").is_file()
    accounting = _accounting(tmp_path / "out", stats)
    assert accounting["dropped"]["dropped_low_quality_score"] == stats["dropped_low_quality_score"]
    assert accounting["dropped"]["skipped_record_request"] > 0  # WARC requests: read, not documents
    scores = [r["score"] for r in _review(tmp_path / "out") if r["reason"] == "dropped_low_quality_score"]
    assert scores and max(scores) < 0.5


def test_a_model_trained_before_scores_in_the_work_units(shared_data, tmp_path):
    """`quality.model`: the work units drop what the saved model scores low, as they clean; the
    output is the unscored run's minus exactly those documents (their duplicates share the score),
    and the artifact keeps the model that scored it."""
    sources = [str(shared_data / "warc"), str(shared_data / DOLMA)]
    reference = [str(shared_data / "corpus" / "nltk_inaugural")]
    trained = _run(tmp_path / "trained", sources=sources, near_dedup=False,
                   quality={"enabled": True, "reference": reference, "threshold": 0.5, "max_train_docs": 400})
    model_dir = shutil.copytree(tmp_path / "trained" / "quality_model", tmp_path / "model")
    unscored = _run(tmp_path / "unscored", sources=sources, near_dedup=False)
    config = {"sources": sources, "near_dedup": False,
              "quality": {"enabled": True, "model": str(model_dir), "threshold": 0.5}}
    scored = _run(tmp_path / "scored", **config)
    model = QualityModel.load(model_dir)
    expected = [d for d in _docs(tmp_path / "unscored") if model.score([d["text"]])[0] >= 0.5]
    assert 0 < len(expected) < unscored.stats["docs_out"]
    assert _docs(tmp_path / "scored") == expected
    stats = scored.stats
    assert stats["dropped_low_quality_score"] >= unscored.stats["docs_out"] - len(expected)
    assert "quality_model_heldout_auc" in trained.stats and "quality_model_heldout_auc" not in stats
    steps = [s["step"] for s in json.loads((tmp_path / "scored" / "funnel.json").read_text())["steps"]]
    assert steps.index("quality_heuristics") < steps.index("quality_model") < steps.index("exact_dedup")
    assert steps.count("quality_model") == 1
    _accounting(tmp_path / "scored", stats)
    review = [r for r in _review(tmp_path / "scored") if r["reason"] == "dropped_low_quality_score"]
    assert review and all(r["score"] < 0.5 for r in review)
    copied = QualityModel.load(tmp_path / "scored" / "quality_model")
    assert np.array_equal(copied.weights, model.weights) and copied.bias == model.bias
    before = fingerprint(collect.Config(**config))
    QualityModel(model.weights * 2, model.bias).save(model_dir)  # another model in its place
    assert fingerprint(collect.Config(**config)) != before
    with pytest.raises(FileNotFoundError, match=r"quality model: .*missing"):
        _run(tmp_path / "bad", sources=sources, quality={"enabled": True, "model": str(tmp_path / "missing")})


def test_bad_inputs_are_quarantined_and_the_stage_completes(shared_data, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    good = shared_data / DOLMA / "cc_en_head-0174.jsonl"
    shutil.copy(good, inputs / "good.jsonl")
    (inputs / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{oops\n\xff\xfe not json\n')
    (inputs / "empty.jsonl.gz").write_bytes(b"")
    (inputs / "binary.jsonl").write_bytes(
        json.dumps({"text": "\x00\x01\x02" * 1000}).encode() + b"\n")
    truncated = gzip.compress(good.read_bytes())
    (inputs / "truncated.jsonl.gz").write_bytes(truncated[: len(truncated) // 2])
    result = _run(tmp_path / "out", sources=[str(inputs)])
    stats = result.stats
    assert stats["error_bad_json"] == 1 and stats["error_invalid_utf8"] == 1
    assert stats["error_empty_file"] == 1
    assert stats["error_truncated_gzip"] == 1 and stats["skipped_binary"] == 1
    alone = _run(tmp_path / "alone", sources=[str(inputs / "good.jsonl")])
    assert stats["docs_out"] == alone.stats["docs_out"] > 5  # nothing good was lost
    quarantined = _review(tmp_path / "out", "quarantine.jsonl")
    assert {"error_bad_json", "error_invalid_utf8", "skipped_binary"} <= \
        {q["reason"] for q in quarantined}
    assert all(q["where"] and q["source"] == str(inputs) for q in quarantined)
    accounting = _accounting(tmp_path / "out", stats)
    assert accounting["quarantined"] == {"error_bad_json": 1, "error_invalid_utf8": 1,
                                         "skipped_binary": 1}
    assert accounting["file_level"] == {"error_empty_file": 1, "error_truncated_gzip": 1}
    before_cut = sum(1 for _ in read_file(inputs / "truncated.jsonl.gz")) - 1  # - the error
    assert 0 < before_cut < 10
    assert accounting["in"] == 10 + 3 + 1 + before_cut  # good, bad, binary, the truncated copy


def test_common_crawl_source_end_to_end(crawl_server, tmp_path):
    result = _run(tmp_path / "out", sources=[f"cc:{CRAWL}?files=2"], cc_base_url=crawl_server.base_url,
                  min_alpha_word_frac=0.8)
    assert result.stats["records_read"] > 0 and result.stats["docs_out"] > 0
    assert result.stats["skipped_record_request"] > 0
    assert not (tmp_path / "out" / "downloads").exists()  # raw files are not kept
    fetched = [path for path, _ in crawl_server.requests if path.endswith(".warc.gz")]
    assert len(fetched) == 2


def test_shard_writes_check_free_space_first(tmp_path, monkeypatch):
    from gristmill.core import files

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: usage._replace(free=100))
    docs = spooled_table(tmp_path / "kept.jsonl", ["word " * 100] * 3)
    with pytest.raises(files.DiskSpaceError, match=r"a document shard in .*docs: needs about"):
        collect.write_shards(docs, tmp_path / "docs", 2, SerialEngine())
    assert not list((tmp_path / "docs").glob("*.gz"))


def test_a_source_without_documents_is_quarantined_and_the_others_go_on(shared_data, tmp_path):
    empty, noise = tmp_path / "empty.jsonl", tmp_path / "noise.warc.gz"
    empty.write_bytes(b"")
    noise.write_bytes(bytes(range(256)) * 64)  # not gzip, not WARC
    good = str(shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0174.jsonl")
    out = tmp_path / "out"
    stats = _run(out, sources=[str(empty), good, str(noise)]).stats
    alone = _run(tmp_path / "alone", sources=[good])
    assert stats["error_source_without_documents"] == 2 and stats["docs_out"] == alone.stats["docs_out"] > 0
    funnel = json.loads((out / "funnel.json").read_text())
    assert funnel["per_source"][str(empty)]["error_source_without_documents"] == 1
    assert funnel["per_source"][good].get("error_source_without_documents", 0) == 0
    quarantined = _review(out, "quarantine.jsonl")
    assert {q["where"] for q in quarantined if q["reason"] == "error_source_without_documents"} == \
        {str(empty), str(noise)}
    accounting = _accounting(out, stats)  # the two sources hold no record: nothing to balance
    assert accounting["file_level"] == {"error_empty_file": 1, "error_corrupt_warc": 1,
                                        "error_source_without_documents": 2}
    assert accounting["per_source"][str(noise)]["in"] == 0 == accounting["per_source"][str(empty)]["in"]


def test_a_document_removed_without_a_count_fails_the_stage(shared_data, tmp_path, monkeypatch):
    real = collect.apply_near_dedup

    def losing(docs, *args):  # a step that drops one document and counts no reason for it
        kept, stats = real(docs, *args)
        return kept.take(np.arange(len(kept) - 1)), stats

    monkeypatch.setattr(collect, "apply_near_dedup", losing)
    good = str(shared_data / DOLMA / "cc_en_head-0174.jsonl")
    with pytest.raises(AccountingError, match=r"does not add up: in 10 = kept \d+ \+ dropped \d+ "
                       rf"\+ quarantined 0 \+ unaccounted 1; by source: '{good}': in 10 = .*unaccounted 1"):
        _run(tmp_path / "out", sources=[good])
    accounting = json.loads((tmp_path / "out" / "funnel.json").read_text())["accounting"]
    assert not accounting["balanced"] and accounting["unaccounted"] == 1
