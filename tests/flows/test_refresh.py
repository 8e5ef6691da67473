"""The data refresh (flows/refresh.py): what counts as new, the corpus-version chain, dedup against
earlier versions, the trigger threshold, and the `data-refresh` deployment with its schedule."""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from corpus_helpers import CRAWL, edited, web_documents, write_jsonl
from pipeline_helpers import gristmill

import gristmill.flows.refresh as refresh
from gristmill.flows.config import load_config, with_overrides
from gristmill.infra.artifacts import ArtifactStore

TINY = "configs/tiny.yaml"


def _sources(*paths: Path) -> str:
    return f"collect.sources={json.dumps([str(p) for p in paths])}"


def test_new_inputs_are_files_no_version_holds_with_that_stamp(tmp_path):
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    (incoming / "a.jsonl").write_text('{"text": "a"}\n')
    (incoming / "notes.md").write_text("not an input format")  # not a collect input: ignored
    config = load_config(TINY, [_sources(incoming)])
    current = refresh.current_inputs(config.collect)
    assert list(current) == [str(incoming / "a.jsonl")]
    versions = [{"version": 1, "inputs": current}]
    assert refresh.new_inputs(current, versions) == {}
    (incoming / "b.jsonl").write_text('{"text": "b"}\n')
    (incoming / "a.jsonl").write_text('{"text": "a, edited"}\n')  # changed: taken again
    now = refresh.current_inputs(config.collect)
    assert set(refresh.new_inputs(now, versions)) == {str(incoming / "a.jsonl"), str(incoming / "b.jsonl")}
    assert refresh.new_inputs(now, [*versions, {"version": 2, "inputs": now}]) == {}
    demo = load_config(TINY)  # demo sources are code: nothing to refresh
    assert refresh.current_inputs(demo.collect) == {}


def test_the_outcome_says_what_was_published():
    published = refresh.Outcome(version=2, new_inputs=1, published=True, parent_version=1,
                                collect_dir="/a/collect-x", new_docs=3, new_tokens=1992, pipeline_run=None,
                                reason="pipeline not started: …")
    assert "## Data refresh: corpus v2" in published.markdown()
    assert "| parent version | v1 |" in published.markdown()
    assert "| pipeline | not started |" in published.markdown()
    nothing = refresh.Outcome(version=2, new_inputs=0, published=False, reason="nothing new since corpus v2")
    assert nothing.markdown() == "## Data refresh: nothing published\n\nnothing new since corpus v2"


def test_the_version_chain_is_kept_by_the_store(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    assert store.corpus_versions() == []
    store.add_corpus_version({"version": 1, "parent_version": None, "collect_key": "a" * 12, "inputs": {}})
    store.add_corpus_version({"version": 2, "parent_version": 1, "collect_key": "b" * 12, "inputs": {}})
    assert [(v["version"], v["parent_version"]) for v in store.corpus_versions()] == [(1, None), (2, 1)]
    assert refresh.corpus_sources(store, store.corpus_versions()) == [
        str(store.final_dir("collect", k * 12) / "docs") for k in "ab"]


class Recorder:
    """Stands in for prefect's run_deployment (the edge): records each call, answers a flow run."""

    def __init__(self, error: Exception | None = None):
        self.calls, self.error = [], error

    def __call__(self, name, **kwargs):
        self.calls.append((name, kwargs))
        if self.error is not None:
            raise self.error
        return SimpleNamespace(id="run-1")


def test_the_threshold_decides_between_starting_the_pipeline_and_saying_why_not(monkeypatch):
    union = ["/store/collect/collect-aaa/docs", "/store/collect/collect-bbb/docs"]
    config = load_config(TINY, ["refresh.min_new_tokens=1000", "collect.mix.weights={demo:python-docs: 2.0}"])
    recorder = Recorder()
    monkeypatch.setattr(refresh, "run_deployment", recorder)

    run, why = refresh.trigger(config, union, 2, new_tokens=999)
    assert run is None and recorder.calls == []
    assert "999 new clean tokens < refresh.min_new_tokens 1,000" in why and json.dumps(union) in why

    run, why = refresh.trigger(with_overrides(config, ["refresh.trigger_pipeline=false"]), union, 2, 5000)
    assert run is None and recorder.calls == [] and "trigger_pipeline is false" in why

    run, why = refresh.trigger(config, union, 2, new_tokens=1000)
    assert run == "run-1" and "pipeline started on corpus v1..v2" in why
    [(name, kwargs)] = recorder.calls
    assert name == "pipeline/pipeline" and kwargs["timeout"] == 0 and "corpus-v2" in kwargs["tags"]
    started = kwargs["parameters"]["config"]
    assert started["collect"]["sources"] == union and started["collect"]["dedup_index_from"] is None
    assert started["collect"]["mix"]["weights"] == {}  # they named the raw sources, not these
    assert started["pretrain"] == config.pretrain.model_dump(mode="json")

    from prefect.exceptions import ObjectNotFound

    monkeypatch.setattr(refresh, "run_deployment", Recorder(ObjectNotFound(http_exc=Exception("404"))))
    run, why = refresh.trigger(config, union, 2, new_tokens=1000)
    assert run is None and "no deployment 'pipeline/pipeline'" in why


def test_the_deployments_served_include_data_refresh_on_its_cron(tmp_path):
    from gristmill.flows.serve import deployments

    config = with_overrides(load_config(TINY), ['refresh.cron="0 4 * * 2"'])
    served = {d.name: d for d in deployments(config)}
    assert set(served) == {"pipeline", "data-refresh"}
    assert [s.schedule.cron for s in served["data-refresh"].schedules] == ["0 4 * * 2"]
    assert not served["pipeline"].schedules
    assert served["data-refresh"].parameters["config"]["refresh"]["cron"] == "0 4 * * 2"


def test_serve_refresh_cron_sets_the_schedule(monkeypatch):
    import gristmill.flows.cli as cli
    import gristmill.flows.serve as serve_flow
    from gristmill.flows import supervised
    from gristmill.infra import supervisor

    served = []
    # the supervised child (`python -m gristmill.flows.supervised serve ARGUMENTS`), run in this process
    monkeypatch.setattr(supervisor, "supervise", lambda argv, **_: supervised.main(list(argv[3:])))
    monkeypatch.setattr(serve_flow, "serve", served.append)
    assert cli.main(["serve", TINY, "--refresh-cron", "0 4 * * 2", "sft.lr=1e-3"]) == 0
    assert served[0].refresh.cron == "0 4 * * 2" and served[0].sft.lr == 1e-3


@pytest.mark.slow
def test_refreshes_publish_versions_that_dedup_against_earlier_ones(shared_data, prefect_server, tmp_path):
    """Three `gristmill refresh` runs: all new (v1), nothing new, one new file holding a
    near-copy of a v1 document and three new documents (v2, the near-copy removed)."""
    originals = web_documents(shared_data, 8)
    incoming, home = tmp_path / "incoming", tmp_path / "home"
    incoming.mkdir()
    write_jsonl(incoming / "week1.jsonl", originals[:5])
    args = ["refresh", TINY, _sources(incoming)]
    first = gristmill(home, *args, services=prefect_server).stdout
    assert first.startswith("corpus v1: ") and "refresh.min_new_tokens 1,000,000" in first

    second = gristmill(home, *args, services=prefect_server).stdout
    assert "nothing new since corpus v1: all 1 input files" in second
    store = ArtifactStore(home / "artifacts")
    started = time.monotonic()  # what the flow does before it answers "nothing new"
    assert refresh.new_inputs(refresh.current_inputs(load_config(TINY, args[2:]).collect),
                              store.corpus_versions()) == {}
    assert time.monotonic() - started < 2

    write_jsonl(incoming / "week2.jsonl", [edited(originals[1]), *originals[5:]])
    third = gristmill(home, *args, "refresh.min_new_tokens=0", services=prefect_server).stdout
    assert third.startswith("corpus v2: ")
    # threshold met; the test's Prefect server has no `pipeline` deployment to start: said so
    assert "no deployment 'pipeline/pipeline'" in third
    v1, v2 = store.corpus_versions()
    assert (v2["version"], v2["parent_version"], list(v2["inputs"])) == (2, 1, [str(incoming / "week2.jsonl")])
    manifest = json.loads((store.collect_dir(v2) / "manifest.json").read_text())
    assert (manifest["meta"]["corpus_version"], manifest["meta"]["parent_version"]) == (2, 1)
    assert manifest["config"]["dedup_index_from"] == str(store.collect_dir(v1))
    assert manifest["stats"]["near_dedup_removed_by_index"] == 1 and manifest["stats"]["docs_out"] == 3
    assert json.loads(third.split("collect.sources=", 1)[1].strip().strip("'")) == \
        refresh.corpus_sources(store, [v1, v2])
    (incoming / "week1.jsonl").touch()  # re-uploaded: taken again, every document already in v1
    fourth = gristmill(home, *args, services=prefect_server).stdout
    assert "1 new input files hold no document that passes the filters and is not already in " \
           "corpus v2; nothing published" in fourth
    assert [v["version"] for v in store.corpus_versions()] == [1, 2]
    with sqlite3.connect(home / "mlflow.db") as db:
        tags = dict(db.execute("select key, value from tags where run_uuid = ? and key like 'gristmill.%'",
                               (manifest["meta"]["mlflow_run_id"],)))
        [refresh_run] = [r for (r,) in db.execute(
            "select run_uuid from tags where key = 'gristmill.corpus.version' and value = '2'")]
        datasets = set(db.execute(
            "select d.name, d.digest, t.value from inputs i join datasets d on d.dataset_uuid = i.source_id "
            "join input_tags t on t.input_uuid = i.input_uuid and t.name = 'mlflow.data.context' "
            "where i.destination_id = ?",
            (refresh_run,)))
    assert tags["gristmill.stage"] == "collect"
    assert datasets == {("corpus-v2", v2["collect_key"], "corpus-version"),
                        ("corpus-v1", v1["collect_key"], "parent-corpus-version")}


def test_new_common_crawl_files_are_collected_from_their_urls(crawl_server, tmp_path):
    """Raising `files=` of a `cc:` source makes only the added file new; the collect stage reads
    it from its URL."""
    import gristmill.tasks.collect.stage as collect
    from gristmill.core.stage import SerialEngine

    def inputs(files: int) -> dict[str, str]:
        config = load_config(TINY, [f"collect.sources=['cc:{CRAWL}?files={files}']",
                                    f"collect.cc_base_url={crawl_server.base_url}"])
        return refresh.current_inputs(config.collect)

    first = inputs(1)
    assert list(first.values()) == [refresh.CC_STAMP]
    new = refresh.new_inputs(inputs(2), [{"version": 1, "inputs": first}])
    assert [url.rsplit("/", 1)[1] for url in new] == ["sample-0000.warc.gz"]
    result = collect.run(collect.Config(sources=list(new)), tmp_path, engine=SerialEngine())
    assert result.stats["records_read"] == 48 and result.stats["docs_out"] > 0  # SOURCES.md: 48 records
