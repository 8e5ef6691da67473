"""Tracking (infra/tracking/) against a real SQLite store: what a computed and a reused stage's
run records, the back-fill of a run that never finished, MLflow's batch limits, a corpus version's
lineage; and a server that does not answer, told apart from MLflow's other errors by type."""
from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

import pytest

from gristmill.core.stage import METRICS_FILE, Manifest


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from gristmill.infra import schemas
    from gristmill.infra.tracking.runs import Tracker

    schemas.seed_mlflow(tmp_path / "home")  # a migrated store, as a run's new home gets
    return Tracker(tmp_path / "home")


class Calls:
    """Counts the MLflow client calls a tracker makes (its client, wrapped)."""

    def __init__(self, tracker):
        self.names: list[str] = []
        inner = tracker.client

        class Counting:
            def __getattr__(_, name):
                self.names.append(name)
                return getattr(inner, name)

        tracker.client = Counting()


def _manifest(root: Path, stage: str, key: str, run_id: str | None, steps: int = 0) -> Manifest:
    path = root / f"{stage}-{key}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    (path / "config.json").write_text("{}")
    (path / METRICS_FILE).write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n"
                                             for s in range(steps)))
    return Manifest(stage=stage, key=key, path=path, config={}, upstream={}, files={},
                    stats={"docs_out": 42, "seconds": 1.5, "ok": True},
                    meta={"mlflow_run_id": run_id} if run_id else {})


def _computed(tracker, tmp_path, stage: str, key: str, upstream=None, steps: int = 3) -> Manifest:
    parent = tracker.start_pipeline("first", {}, {})
    run_id = tracker.start_stage(parent, stage, key, {"lr": 0.1}, upstream or {})
    manifest = _manifest(tmp_path / "store", stage, key, run_id, steps)
    with tracker.follow_metrics(run_id, manifest.path / METRICS_FILE):
        pass
    tracker.finish_stage(run_id, manifest, [])
    return manifest


def test_a_reused_stage_is_recorded_in_five_calls_pointing_at_the_run_that_computed_it(tracker, tmp_path):
    collect = _computed(tracker, tmp_path, "collect", "c1")
    tokenize = _computed(tracker, tmp_path, "tokenize", "t1", {"collect": collect})
    parent = tracker.start_pipeline("again", {}, {})
    calls = Calls(tracker)
    run_id, backfilled = tracker.record_reused_stage(parent, "tokenize", "t1", {"vocab_size": 512},
                                                     {"collect": collect}, tokenize)
    tracker.end(run_id, ok=True)
    assert not backfilled
    # one to ask whether the computing run finished, four to record the stage
    assert calls.names == ["get_run", "create_run", "log_batch", "log_inputs", "set_terminated"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.uri)
    run = client.get_run(run_id)
    tags = run.data.tags
    assert run.info.status == "FINISHED" and tags["mlflow.parentRunId"] == parent
    assert tags["gristmill.reused"] == "true" and "gristmill.backfilled" not in tags
    assert tags["gristmill.source_run_id"] == tokenize.meta["mlflow_run_id"]
    assert tags["gristmill.upstream.collect.run_id"] == collect.meta["mlflow_run_id"]
    assert tags["gristmill.artifact_dir"] == str(tokenize.path)
    assert run.data.params == {"vocab_size": "512"}
    assert run.data.metrics == {"docs_out": 42.0, "seconds": 1.5}  # the bool is not a metric
    assert [d.dataset.digest for d in run.inputs.dataset_inputs] == ["c1"]
    # the step metrics and files stay with the run that computed them
    assert client.get_metric_history(run_id, "loss") == []
    assert len(client.get_metric_history(tokenize.meta["mlflow_run_id"], "loss")) == 3
    assert client.list_artifacts(run_id) == []


def test_whether_a_run_finished_is_one_get_run(tracker, tmp_path):
    """Finished, cut short, unknown to this store (another store's id): one `get_run` each; no
    run id asks nothing."""
    collect = _computed(tracker, tmp_path, "collect", "c1")
    parent = tracker.start_pipeline("lost", {}, {})
    cut_short = tracker.start_stage(parent, "pretrain", "p1", {}, {})
    calls = Calls(tracker)
    asked = [tracker.finished(r) for r in (collect.meta["mlflow_run_id"], cut_short, "0" * 32, None)]
    assert asked == [True, False, False, False]
    assert calls.names == ["get_run"] * 3


def test_a_run_still_running_is_waited_for_only_as_long_as_asked(tracker, monkeypatch):
    """A run that ends while it is waited for counts as finished; one that never ends does not,
    once the wait is over; a failed run is not waited for."""
    import threading

    from gristmill.infra.tracking import runs

    monkeypatch.setattr(runs, "FINISH_POLL_S", 0.1)
    parent = tracker.start_pipeline("first", {}, {})
    ending, stuck, failed = (tracker.start_stage(parent, s, "k", {}, {}) for s in ("sft", "align", "evaluate"))
    tracker.end(failed, ok=False)
    threading.Timer(0.5, tracker.end, (ending, True)).start()
    assert tracker.finished(ending, wait_s=30)
    started = time.monotonic()
    assert not tracker.finished(stuck, wait_s=1.0)
    assert 1.0 <= time.monotonic() - started < 5
    started = time.monotonic()
    assert not tracker.finished(failed, wait_s=30) and time.monotonic() - started < 5


def test_a_reused_stage_whose_computing_run_never_finished_backfills_it(tracker, tmp_path):
    parent = tracker.start_pipeline("lost", {}, {})
    cut_short = tracker.start_stage(parent, "pretrain", "p1", {}, {})  # MLflow lost mid-stage
    manifest = _manifest(tmp_path / "store", "pretrain", "p1", cut_short, steps=4)
    again = tracker.start_pipeline("again", {}, {})
    run_id, backfilled = tracker.record_reused_stage(again, "pretrain", "p1", {}, {}, manifest)
    tracker.end(run_id, ok=True)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.uri)
    assert backfilled and client.get_run(run_id).data.tags["gristmill.backfilled"] == "true"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1, 2, 3]
    assert {a.path for a in client.list_artifacts(run_id)} == {"manifest.json", "config.json"}


def test_batches_respect_mlflows_limits(tracker, tmp_path):
    """250 params and 2,500 step metrics: every one logged, each call within MLflow's limits
    (which it enforces: a call over them fails)."""
    parent = tracker.start_pipeline("big", {f"p{i}": i for i in range(250)}, {})
    manifest = _manifest(tmp_path / "store", "sft", "s1", None, steps=2500)
    run_id = tracker.start_stage(parent, "sft", "s1", {}, {})
    with tracker.follow_metrics(run_id, manifest.path / METRICS_FILE):
        pass
    tracker.finish_stage(run_id, manifest, [])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.uri)
    assert len(client.get_run(parent).data.params) == 250
    assert len(client.get_metric_history(run_id, "loss")) == 2500


def test_lineage_survives_another_run_logging_the_same_dataset_at_once(tracker, tmp_path):
    """Two runs of one config log the same upstream dataset together; MLflow's look-up-then-insert
    lets both insert, and the later one fails on the unique constraint (seen in the fault suite's
    concurrent trial). Replayed here: the other run's insert lands between this run's look-up and
    insert, and this run's lineage still links to the one dataset row."""
    import sqlalchemy
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from gristmill.infra.tracking.runs import Tracker

    collect = _computed(tracker, tmp_path, "collect", "c1")
    other = Tracker(tmp_path / "home")
    real, raced = tracker.client.log_inputs, []

    def racing(run_id, datasets, models=()):
        if not raced:  # the other run inserts first; this run's insert then violates the constraint
            raced.append(other.start_stage(other.start_pipeline("other", {}, {}), "tokenize", "t1",
                                           {}, {"collect": collect}))
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: "
                                  "datasets.experiment_id, datasets.name, datasets.digest") \
                from sqlalchemy.exc.IntegrityError("INSERT INTO datasets", {}, None)
        return real(run_id, datasets=datasets, models=models)

    tracker.client.log_inputs = racing
    run_id = tracker.start_stage(tracker.start_pipeline("this", {}, {}), "tokenize", "t1", {},
                                 {"collect": collect})
    client = MlflowClient(tracker.uri)
    names = {i.dataset.name for r in (run_id, raced[0]) for i in client.get_run(r).inputs.dataset_inputs}
    assert names == {"collect-c1"}


def test_a_corpus_version_is_a_dataset_of_its_run_next_to_the_version_it_extends(tracker, tmp_path):
    from mlflow.tracking import MlflowClient

    from gristmill.infra.tracking.corpus import log_corpus_version

    v1, v2 = (_manifest(tmp_path / "store", "collect", key, None) for key in ("c1", "c2"))
    run_id = tracker.start_pipeline("refresh v2", {}, {"gristmill.kind": "refresh"})
    log_corpus_version(tracker, run_id, 2, v2, (1, v1))
    run = MlflowClient(tracker.uri).get_run(run_id)
    datasets = {(i.dataset.name, i.dataset.digest, i.dataset.source, i.tags[0].value)
                for i in run.inputs.dataset_inputs}
    assert datasets == {("corpus-v2", "c2", v2.path.resolve().as_uri(), "corpus-version"),
                        ("corpus-v1", "c1", v1.path.resolve().as_uri(), "parent-corpus-version")}
    assert {k: v for k, v in run.data.tags.items() if k.startswith("gristmill.corpus.")} == {
        "gristmill.corpus.version": "2", "gristmill.corpus.key": "c2", "gristmill.corpus.parent_version": "1"}


def test_a_stage_model_is_logged_once_as_a_chat_model(tracker, tmp_path, tiny_model_dir, monkeypatch):
    """The stage's `model/` becomes a logged model of its run (transformers flavour, chat task),
    tagged with the artifact; a run that reuses the stage finds it in one search and logs
    nothing. Loaded through `models:/<id>`, it takes chat messages, renders them with the
    tokenizer's chat template and answers with the greedy continuation."""
    import shutil

    import mlflow
    import torch
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gristmill.core.chat import prompt_ids
    from gristmill.flows.reports import publish_model

    manifest = _manifest(tmp_path / "store", "sft", "s1", None)
    shutil.copytree(tiny_model_dir, manifest.path / "model")
    run_id = tracker.start_stage(tracker.start_pipeline("first", {}, {}), "sft", "s1", {}, {})
    publish_model(manifest, tracker, run_id, True)
    client = MlflowClient(tracker.uri)
    [model] = client.search_logged_models([tracker.experiment_id])
    assert (model.status, model.source_run_id, model.name) == ("READY", run_id, "sft-s1")
    assert {k: model.tags[k] for k in ("gristmill.stage", "gristmill.key")} == {
        "gristmill.stage": "sft", "gristmill.key": "s1"}
    assert [o.model_id for o in client.get_run(run_id).outputs.model_outputs] == [model.model_id]

    calls = Calls(tracker)
    publish_model(manifest, tracker, run_id, False)  # a reused stage
    assert calls.names == ["search_logged_models"]
    assert len(client.search_logged_models([tracker.experiment_id])) == 1

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.uri)
    loaded = mlflow.pyfunc.load_model(f"models:/{model.model_id}")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    [reply] = loaded.predict({"messages": messages, "max_tokens": 6})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = prompt_ids(tokenizer, messages)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    out = hf_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    continuation = out[0, len(prompt):].tolist()
    assert reply["object"] == "chat.completion" and reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["usage"]["completion_tokens"] == len(continuation)
    assert reply["choices"][0]["message"] == {
        "role": "assistant", "content": tokenizer.decode(continuation, skip_special_tokens=True).strip()}


def test_evaluation_metrics_are_logged_against_the_models_and_the_data(tracker, tmp_path):
    """The evaluate stage's SFT and aligned scores, each logged against its logged model and the
    data it was measured on: the val split (the tokenize artifact, in the lineage), the generated
    arithmetic problems, each benchmark file; `core` against no single one. Only by the run that
    owns the artifact's outputs."""
    from mlflow.tracking import MlflowClient

    from gristmill.flows.reports import measured_on, publish_evaluate
    from gristmill.infra.tracking.models import KEY_TAG, STAGE_TAG

    tokenize = _manifest(tmp_path / "store", "tokenize", "t1", None)
    bench = tmp_path / "hellaswag_part1.jsonl"
    bench.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
    evaluate = Manifest(
        stage="evaluate", key="e1", path=tmp_path, upstream={"tokenize": "t1", "sft": "s1", "align": "a1"},
        config={"arith_problems": 20, "arith_seed": 0, "tasks": [str(bench)]}, files={},
        stats={"base_val_ppl": 9.0, "sft_val_ppl": 7.0, "sft_arith_acc": 0.25, "sft_hellaswag_part1_acc": 0.5,
               "sft_hellaswag_part1_acc_clean": 0.5, "sft_core": 0.1, "aligned_val_ppl": 6.0,
               "aligned_arith_acc": 0.4, "aligned_hellaswag_part1_acc": 0.5, "aligned_core": 0.2, "seconds": 3.0})
    models = {}
    for stage, key in (("sft", "s1"), ("align", "a1")):
        models[stage] = tracker.client.create_logged_model(tracker.experiment_id,
                                                           tags={STAGE_TAG: stage, KEY_TAG: key}).model_id
        tracker.client.finalize_logged_model(models[stage], "READY")
    run_id = tracker.start_stage(tracker.start_pipeline("eval", {}, {}), "evaluate", "e1", {}, {"tokenize": tokenize})
    calls = Calls(tracker)
    publish_evaluate(evaluate, tracker, run_id, False)  # a reused stage: its computing run has them
    assert calls.names == []
    publish_evaluate(evaluate, tracker, run_id, True)

    client = MlflowClient(tracker.uri)
    arith = measured_on(evaluate, "sft")[1][0]
    assert arith.name == "arithmetic-test" and len(arith.digest) == 12
    other_problems = dataclasses.replace(evaluate, config={**evaluate.config, "arith_seed": 1})
    assert measured_on(other_problems, "sft")[1][0].digest != arith.digest  # another dataset
    bench_digest = next(d.digest for d, _ in measured_on(evaluate, "sft") if d and d.name == "hellaswag_part1")
    logged = {(m.key, m.dataset_name, m.dataset_digest, m.value)
              for m in client.get_logged_model(models["sft"]).metrics}
    assert logged == {("sft_val_ppl", "tokenize-t1", "t1", 7.0),
                      ("sft_arith_acc", "arithmetic-test", arith.digest, 0.25),
                      ("sft_hellaswag_part1_acc", "hellaswag_part1", bench_digest, 0.5),
                      ("sft_hellaswag_part1_acc_clean", "hellaswag_part1", bench_digest, 0.5),
                      ("sft_core", None, None, 0.1)}
    assert {m.key for m in client.get_logged_model(models["align"]).metrics} == {
        "aligned_val_ppl", "aligned_arith_acc", "aligned_hellaswag_part1_acc", "aligned_core"}
    run = client.get_run(run_id)
    assert {i.model_id for i in run.inputs.model_inputs} == set(models.values())
    assert {(i.dataset.name, i.dataset.source) for i in run.inputs.dataset_inputs} == {
        ("tokenize-t1", tokenize.path.resolve().as_uri()), ("hellaswag_part1", str(bench)),
        ("arithmetic-test", "gristmill.core.arithmetic?split=test&n=20&seed=0")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def impatient(monkeypatch):
    """MLflow's HTTP client without retries and with a one-second timeout."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")


def _unavailable(tmp_path, monkeypatch, uri: str) -> Exception:
    """What opening a tracker on `uri` raises, within a few seconds."""
    from gristmill.infra.tracking import TrackingUnavailable
    from gristmill.infra.tracking.runs import Tracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.monotonic()
    with pytest.raises(TrackingUnavailable) as raised:
        Tracker(tmp_path / "home")
    assert time.monotonic() - started < 15
    return raised.value


def test_a_port_nobody_listens_on_is_tracking_unavailable(tmp_path, monkeypatch, impatient):
    from mlflow.exceptions import MlflowException

    uri = f"http://127.0.0.1:{_free_port()}"
    error = _unavailable(tmp_path, monkeypatch, uri)
    assert str(error).startswith(f"MLflow at {uri} is not answering (get_experiment_by_name)")
    assert isinstance(error.__cause__, MlflowException)


def test_a_server_that_never_replies_is_tracking_unavailable(tmp_path, monkeypatch, impatient):
    with socket.socket() as silent:  # connections are accepted (by the kernel), never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        assert "not answering" in str(_unavailable(tmp_path, monkeypatch, uri))


def test_only_a_request_left_unanswered_counts_as_unavailable(tracker):
    """By the error's type, not its words: MLflow's own errors pass through unchanged, whatever
    they say; one raised from or while handling a connection error, timeout or exhausted retries
    is a server that did not answer."""
    from mlflow.exceptions import MlflowException
    from requests import exceptions as http_errors

    from gristmill.infra.tracking import unanswered

    with pytest.raises(MlflowException, match="not found"):
        tracker.client.get_run("0" * 32)
    assert not unanswered(MlflowException("API request to http://x failed with error code 404 != 200"))

    def raised(inner: Exception, cause: bool) -> MlflowException:
        """MLflow's error raised from `inner` (its cause), or while handling it (its context)."""
        try:
            try:
                raise inner
            except Exception as error:
                if cause:
                    raise MlflowException("API request to http://x failed") from error
                raise MlflowException("API request to http://x failed")  # noqa: B904 (as MLflow does)
        except MlflowException as outer:
            return outer

    for inner in (http_errors.ConnectionError(), http_errors.ReadTimeout(), http_errors.RetryError()):
        assert unanswered(raised(inner, cause=True)) and unanswered(raised(inner, cause=False))
    assert not unanswered(raised(ValueError("bad value"), cause=True))


def test_step_metrics_reach_the_run_while_the_stage_computes(tracker, tmp_path, monkeypatch):
    """Rows appended to metrics.jsonl are in MLflow before the stage ends; a row being written is
    sent once its line is complete."""
    from mlflow.tracking import MlflowClient

    from gristmill.infra.tracking import runs

    monkeypatch.setattr(runs, "FOLLOW_EVERY_S", 0.05)
    client = MlflowClient(tracker.uri)
    run_id = tracker.start_stage(tracker.start_pipeline("live", {}, {}), "pretrain", "p1", {}, {})
    path = tmp_path / METRICS_FILE

    def steps_sent(count: int) -> list[int]:
        deadline = time.monotonic() + 20
        while len(history := client.get_metric_history(run_id, "loss")) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return sorted(m.step for m in history)

    with tracker.follow_metrics(run_id, path):
        path.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2)))
        assert steps_sent(2) == [1, 2]
        with path.open("a") as handle:
            handle.write(json.dumps({"step": 3, "loss": 2.0})[:8])
            handle.flush()
            time.sleep(0.3)
            assert steps_sent(2) == [1, 2]
            handle.write(json.dumps({"step": 3, "loss": 2.0})[8:] + "\n")
        assert steps_sent(3) == [1, 2, 3]
    assert steps_sent(3) == [1, 2, 3]


def test_models_back_filled_at_once_load_whole(tiny_model_dir):
    """The reused stages' publishers log the SFT and aligned models on threads at once; transformers'
    loading is not thread-safe (two loads at once put the tied output head on the meta device, and
    saving it fails). Loads are serialised: every one of many concurrent loads is whole."""
    import threading

    from gristmill.infra.tracking.models import load_chat_components

    broken: list[list[str]] = []

    def load() -> None:
        model = load_chat_components(tiny_model_dir)["model"]
        broken.append([name for name, param in model.named_parameters(remove_duplicate=False) if param.is_meta])

    for _ in range(8):
        threads = [threading.Thread(target=load) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(broken) == 16 and not any(broken), broken


def test_artifacts_of_a_sqlite_tracking_uri_live_beside_its_database(tmp_path, monkeypatch):
    """With MLFLOW_TRACKING_URI naming a SQLite file, artifacts go beside it, never into ./mlruns of
    the directory a run happens to start in."""
    from gristmill.infra import schemas
    from gristmill.infra.tracking.runs import Tracker

    db = tmp_path / "tracking" / "mlflow.db"
    db.parent.mkdir()
    schemas.seed_mlflow(tmp_path / "home")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    tracker = Tracker(tmp_path / "home")
    _computed(tracker, tmp_path, "collect", "abc")
    location = tracker.client.get_experiment(tracker.experiment_id).artifact_location
    assert location == (db.parent / "mlruns").as_uri()
    assert not (elsewhere / "mlruns").exists()
