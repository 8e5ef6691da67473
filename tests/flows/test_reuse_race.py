"""A stage that another run computed while this run waited for the key's lock counts as reused,
not computed: in the run's outcomes (the pipeline-summary and report card read them), in the
Prefect task run's name and in MLflow (`gristmill.reused=true`, `gristmill.source_run_id` naming the
computing run). The flow's own task (flows/pipeline.run_stage) runs against a real artifact store,
a real flock held by another thread, the session's Prefect server and a SQLite MLflow store;
no pipeline runs."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from gristmill.core.stage import StageConfig

pytestmark = pytest.mark.slow  # asks for the session's Prefect server


class Config(StageConfig):
    size: int = 1


def _never_loaded():
    raise AssertionError("the stage's code was loaded: this run was to reuse what another run computed")


class Waiting(logging.Handler):
    """Sets `event` once the store logs that a run waits for a key another run holds."""

    def __init__(self, event: threading.Event):
        super().__init__(logging.INFO)
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting for it" in record.getMessage():
            self.event.set()


def _other_run(store, tracker, key: str, holding: threading.Event, waiting: threading.Event):
    """Another run computing `key`: it holds the lock until this run waits on it, and ends its MLflow
    stage run a moment after committing, as a run does once it has logged the stage's stats."""
    parent = tracker.start_pipeline("other", {}, {})
    runs = []

    def compute(partial: Path) -> dict:
        runs.append(tracker.start_stage(parent, "noop", key, {"size": 1}, {}))
        holding.set()
        assert waiting.wait(120), "the run under test never waited for the lock"
        (partial / "out.txt").write_text("computed by the other run\n")
        return {"config": {"size": 1}, "upstream": {}, "stats": {"docs_out": 3},
                "meta": {"mlflow_run_id": runs[0]}}

    result = store.materialize("noop", key, compute)
    time.sleep(2)  # still logging: the run that waited must not take it for a run that died
    tracker.end(runs[0], ok=True)
    return result


def _finished_task_runs(flow_run_id, timeout_s: float = 60) -> list:
    """The flow run's task runs once each is recorded in a final state: the server records task
    runs from their state events, a moment after the flow run itself has finished."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if (runs and all(r.state is not None and r.state.is_final() for r in runs)) or time.monotonic() > deadline:
                return runs
            time.sleep(0.5)


def test_a_stage_computed_meanwhile_by_another_run_is_reused_in_summary_prefect_and_mlflow(
        prefect_server, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow.tracking import MlflowClient
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gristmill.flows.dag import PlannedStage
    from gristmill.flows.pipeline import Runtime, _summary, run_stage
    from gristmill.flows.stages import StageSpec
    from gristmill.infra import schemas
    from gristmill.infra.artifacts import ArtifactStore
    from gristmill.infra.tracking.runs import Tracker

    home, key = tmp_path / "home", "race0000test"
    schemas.seed_mlflow(home)
    tracker, store = Tracker(home), ArtifactStore(home / "artifacts")
    # the stage's own code never runs here: the other run computes, this one must wait and reuse
    spec = StageSpec(name="noop", run=_never_loaded, config=Config, description="none", version=1)
    stage = PlannedStage(spec=spec, config=Config(), key=key, complete=False)  # planned to run
    parent = tracker.start_pipeline("this", {}, {})
    runtime = Runtime(store, tracker, parent, config=None)  # no launched stage reads it

    holding, waiting = threading.Event(), threading.Event()
    store_log = logging.getLogger("gristmill.store")
    handler, level = Waiting(waiting), store_log.level
    store_log.addHandler(handler)
    store_log.setLevel(logging.INFO)
    other: dict = {}
    thread = threading.Thread(target=lambda: other.update(result=_other_run(store, tracker, key, holding, waiting)))
    thread.start()
    try:
        assert holding.wait(60), "the other run never took the lock"

        @flow
        def one_stage():
            return run_stage.with_options(task_run_name="noop [run]")(stage, {}, runtime)

        with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
            state = one_stage(return_state=True)
            assert state.is_completed(), state
            manifest = state.result()
            task_runs = _finished_task_runs(state.state_details.flow_run_id)
    finally:
        waiting.set()
        thread.join(120)
        store_log.removeHandler(handler)
        store_log.setLevel(level)
    computed, reused_there = other["result"]
    assert not reused_there and manifest.path == computed.path
    source = computed.meta["mlflow_run_id"]
    assert manifest.meta["mlflow_run_id"] == source

    # MLflow: one stage run under this run's parent, a reuse pointing at the run that computed it
    client = MlflowClient(tracker.uri)
    children = client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert [run.data.tags["gristmill.reused"] for run in children] == ["true"]
    tags = children[0].data.tags
    # it pointed at the computing run once that run ended, and copied none of its record
    assert tags["gristmill.source_run_id"] == source and "gristmill.backfilled" not in tags
    assert children[0].info.status == "FINISHED"

    # the summary and report card read the outcome; the task run is named for it
    assert runtime.outcomes == {"noop": "reused"}
    assert f"| noop | {key} | reused |" in _summary([stage], {"noop": manifest}, runtime.outcomes)
    assert [run.name for run in task_runs] == ["noop [reuse]"]
