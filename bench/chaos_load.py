"""Under load: `python -m bench chaos --load N [--work DIR] [key=value ...]`.

N runs of the tiny preset (shortened as in the end-to-end tests; overrides on the command line
change it) started at once in one fresh home against one standing stack (`gristmill up`'s Prefect
server, MLflow server and Ray head), through the Prefect API as the UI starts them: `gristmill
serve` registers the `pipeline` deployment and its runner runs the flow runs created from it
(create_flow_run_from_deployment), up to N at a time. Half the runs keep the deployment's defaults;
the other half split between two evaluate-only variants (VARIANTS), so every stage but evaluate
has one key all N runs race for and evaluate has three, each raced for by several runs. The plan
and the checks below, on plain data, are bench/harness/load_trial.py's.

When every run has ended it checks, from the artifact store's manifests (the truth: each names
the Prefect flow run and MLflow run that computed it), MLflow's stage runs and each run's
`pipeline-summary` Prefect artifact:

  finished          runs that ended Completed
  computed_once     keys computed by exactly one stage run, the one its manifest names
  truthful_records  (run, stage) pairs with one MLflow stage run whose `gristmill.reused` and
                    `gristmill.source_run_id` agree with the manifest, and a summary row that does too
  backfilled        reused stage runs that back-filled their computing run's metrics: that run had
                    not finished its MLflow run yet when the reuse was recorded

It prints one row per run and ends with one JSON line: {"runs", "finished", "keys",
"computed_once", "records", "truthful_records", "backfilled", "leftover_partials", "wall_s"}.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.harness.load_trial import overrides_of, summary_statuses, tally
from bench.harness.runs import REPO, STAGES, cli_env
from gristmill.infra.processes import interrupt

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
POLL_S = 2.0


def _manifests(home: Path) -> dict[tuple[str, str], dict[str, str]]:
    found = {}
    for path in (home / "artifacts").glob("*/*/manifest.json"):
        manifest = json.loads(path.read_text())
        found[manifest["stage"], manifest["key"]] = {"flow_run": manifest["meta"].get("prefect_flow_run_id"),
                                                     "mlflow_run": manifest["meta"].get("mlflow_run_id")}
    return found


def _records(home: Path) -> list[dict[str, Any]]:
    """Every MLflow stage run of the home's tracking server, with its pipeline run's flow run."""
    from gristmill.infra.tracking.runs import Tracker

    tracker = Tracker(home)
    parents = {r.info.run_id: r.data.tags.get("prefect.flow_run_id") for r in tracker.client.search_runs(
        [tracker.experiment_id], "tags.`gristmill.kind` = 'pipeline'", max_results=1000)}
    return [{"flow_run": parents.get(tags.get("mlflow.parentRunId")), "stage": tags.get("gristmill.stage"),
             "key": tags.get("gristmill.key"), "run_id": r.info.run_id,
             "reused": tags.get("gristmill.reused") == "true", "source_run_id": tags.get("gristmill.source_run_id"),
             "backfilled": tags.get("gristmill.backfilled") == "true"}
            for r in tracker.client.search_runs([tracker.experiment_id], "tags.`gristmill.kind` = 'stage'",
                                                max_results=1000)
            for tags in [r.data.tags]]


def _deployment(client: Any, serve: subprocess.Popen, timeout_s: float = 600) -> Any:
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.read_deployment_by_name("pipeline/pipeline")
        except ObjectNotFound:
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("chaos --load: `gristmill serve` registered no deployment; see its log") from None
            time.sleep(POLL_S)


def _start_and_wait(api_url: str, serve: subprocess.Popen, overrides: list[list[str]],
                    timeout_s: float) -> tuple[dict[str, str], dict[str, dict[str, str]], float]:
    """Create one flow run per entry of `overrides` from the deployment, at once; wait for all to
    end. Returns (flow run -> state type, flow run -> its summary statuses, wall seconds)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        deployment = _deployment(client, serve)
        started = time.monotonic()
        ids = [str(client.create_flow_run_from_deployment(deployment.id, parameters={"overrides": o}).id)
               for o in overrides]
        states: dict[str, str] = {}
        while len(states) < len(ids) and time.monotonic() - started < timeout_s:
            time.sleep(POLL_S)
            for run_id in ids:
                state = client.read_flow_run(run_id).state
                if state is not None and state.type.value in TERMINAL:
                    states.setdefault(run_id, state.type.value)
        wall = time.monotonic() - started
        states = {run_id: states.get(run_id, "UNFINISHED") for run_id in ids}
        summaries = {}
        for run_id in ids:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["pipeline-summary"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
            summaries[run_id] = summary_statuses(str(found[0].data)) if found else {}
    return states, summaries, wall


def run_load(runs: int, base_overrides: list[str], work: Path, timeout_s: float = 5400) -> dict[str, Any]:
    """The load trial in `work` (a fresh home under it); returns the tally, with wall_s."""
    from gristmill.infra import stack

    home = work / "home"
    home.mkdir(parents=True)
    plan = overrides_of(runs)
    serve = None
    try:
        states = stack.up(home, ports=stack.Ports.free())
        exports = {k: v for s in states for k, v in s.export.items()}
        # the runner runs at most PREFECT_RUNNER_PROCESS_LIMIT flow runs at once (Prefect's
        # default: 5); the load is N at once, and found quickly (the default polls every 10 s)
        env = {**cli_env(home, exports), "PREFECT_RUNNER_PROCESS_LIMIT": str(runs),
               "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
        with (work / "serve.log").open("w") as log:
            serve = subprocess.Popen([sys.executable, "-m", "gristmill", "serve", "configs/tiny.yaml",
                                      *base_overrides], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        run_states, summaries, wall = _start_and_wait(exports["PREFECT_API_URL"], serve, plan, timeout_s)
        os.environ["MLFLOW_TRACKING_URI"] = exports["MLFLOW_TRACKING_URI"]
        result = tally(run_states, _manifests(home), _records(home), summaries)
    finally:
        if serve is not None:
            interrupt(serve, grace_s=60)
        stack.down(home)
    result["leftover_partials"] = sum(1 for _ in (home / "artifacts").glob("*/*.partial"))
    result["wall_s"] = round(wall)
    result["plan"] = dict(zip(run_states, plan))
    result["states"] = run_states
    return result


def report(result: Mapping[str, Any]) -> dict[str, Any]:
    """One row per run (state, then per stage C = computed, r = reused, ? = a record that is not
    the truth), and the headline figures."""
    print(f"{'run':<10} {'overrides':<28} {'state':<10} " + " ".join(f"{s[:8]:<8}" for s in STAGES))
    mark = {"computed": "C", "reused": "r"}
    for run, state in result["states"].items():
        stages = result["per_run"].get(run, {})
        print(f"{run[:8]:<10} {' '.join(result['plan'][run]) or '(defaults)':<28} {state:<10} "
              + " ".join(f"{mark.get(stages.get(s, '-'), stages.get(s, '-')):<8}" for s in STAGES))
    return {k: result[k] for k in ("runs", "finished", "keys", "computed_once", "records", "truthful_records",
                                   "backfilled", "leftover_partials", "wall_s")}
