"""Stage runs in MLflow (infra/tracking.py) against a real SQLite store: what a computed and a
reused stage's run records, the back-fill of a run that never finished, and MLflow's batch limits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.stage import METRICS_FILE, Manifest


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from infra.tracking import Tracker

    return Tracker(tmp_path / "home")


class Calls:
    """Counts the MLflow client calls a tracker makes (its guarded client, wrapped)."""

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
    tracker.finish_stage(run_id, manifest, [], replay_metrics=True)
    return manifest


def test_a_reused_stage_is_recorded_in_four_calls_pointing_at_the_run_that_computed_it(tracker, tmp_path):
    collect = _computed(tracker, tmp_path, "collect", "c1")
    tokenize = _computed(tracker, tmp_path, "tokenize", "t1", {"collect": collect})
    parent = tracker.start_pipeline("again", {}, {})
    calls = Calls(tracker)
    run_id, backfilled = tracker.record_reused_stage(parent, "tokenize", "t1", {"vocab_size": 512},
                                                     {"collect": collect}, tokenize)
    tracker.end(run_id, ok=True)
    assert not backfilled
    # four calls to record the stage: that the computing run finished, the home's ledger says
    assert calls.names == ["create_run", "log_batch", "log_inputs", "set_terminated"]
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


def test_a_run_that_finished_elsewhere_is_asked_about_once(tracker, tmp_path):
    """A run ended by another home (or before the ledger existed) is looked up in MLflow once,
    then known; one that never finished is asked about again each time."""
    collect = _computed(tracker, tmp_path, "collect", "c1")
    tracker.ledger.unlink()
    parent = tracker.start_pipeline("lost", {}, {})
    cut_short = tracker.start_stage(parent, "pretrain", "p1", {}, {})
    calls = Calls(tracker)
    assert [tracker.finished(collect.meta["mlflow_run_id"]) for _ in range(2)] == [True, True]
    assert [tracker.finished(cut_short) for _ in range(2)] == [False, False]
    assert calls.names == ["get_run", "get_run", "get_run"]


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
    tracker.finish_stage(run_id, manifest, [], replay_metrics=True)
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

    from infra.tracking import Tracker

    collect = _computed(tracker, tmp_path, "collect", "c1")
    other = Tracker(tmp_path / "home")
    real, raced = tracker.client.log_inputs, []

    def racing(run_id, datasets):
        if not raced:  # the other run inserts first; this run's insert then violates the constraint
            raced.append(other.start_stage(other.start_pipeline("other", {}, {}), "tokenize", "t1",
                                           {}, {"collect": collect}))
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: "
                                  "datasets.experiment_id, datasets.name, datasets.digest") \
                from sqlalchemy.exc.IntegrityError("INSERT INTO datasets", {}, None)
        return real(run_id, datasets=datasets)

    tracker.client.log_inputs = racing
    run_id = tracker.start_stage(tracker.start_pipeline("this", {}, {}), "tokenize", "t1", {},
                                 {"collect": collect})
    client = MlflowClient(tracker.uri)
    names = {i.dataset.name for r in (run_id, raced[0]) for i in client.get_run(r).inputs.dataset_inputs}
    assert names == {"collect-c1"}
