"""Pipeline and stage runs in MLflow, their metrics and lineage, and reading them back.

One parent run per pipeline run and one child run per stage (also for reused stages, tagged
`gristmill.reused=true` and pointing at the run that computed the artifact). A stage run carries
its resolved config as params, its stats and step-wise metrics, small artifacts, and its lineage:
each upstream artifact as an MLflow dataset input (digest = artifact key, source = its directory)
plus a tag naming the upstream stage's run. A reused stage whose computing run never finished
(MLflow was lost mid-stage) logs that stage's metrics and files into its own run instead
(tagged `gristmill.backfilled`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow.entities import (
    Dataset,
    DatasetInput,
    InputTag,
    LoggedModelInput,
    Metric,
    Param,
    RunStatus,
    RunTag,
)
from mlflow.exceptions import MlflowException

from gristmill.core.stage import METRICS_FILE, Manifest, read_metrics
from gristmill.infra import env
from gristmill.infra.artifacts import CONFIG, MANIFEST
from gristmill.infra.tracking import Client, tracking_uri

EXPERIMENT = "gristmill"
MAX_PARAM_CHARS = 6000  # MLflow's limit on one param value
BATCH = 900  # MLflow accepts at most 1000 values (metrics + params + tags) per log_batch
PARAMS_PER_BATCH = 100  # and at most 100 params (and 100 tags) of them
FINISHED = RunStatus.to_string(RunStatus.FINISHED)
RUNNING = RunStatus.to_string(RunStatus.RUNNING)
FINISH_POLL_S = 1.0  # how often a run waiting for another run to end its MLflow run asks
FOLLOW_EVERY_S = 2.0  # how often a computing stage's new step metrics are sent to its run

log = logging.getLogger("gristmill.tracking")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: how nested configs become MLflow params."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _now_ms() -> int:
    return int(time.time() * 1000)


def _params(config: Mapping[str, Any]) -> list[Param]:
    return [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in flatten(config).items()]


def _step_metrics(rows: Iterable[Mapping[str, Any]]) -> list[Metric]:
    """metrics.jsonl rows as MLflow metrics at their steps."""
    stamp = _now_ms()
    return [Metric(k, v, stamp, int(row["step"])) for row in rows for k, v in numeric(row).items() if k != "step"]


def _stage_metrics(manifest: Manifest, with_steps: bool) -> list[Metric]:
    """The manifest's numeric stats (step 0) and, when `with_steps`, its metrics.jsonl rows."""
    metrics = [Metric(k, v, _now_ms(), 0) for k, v in numeric(manifest.stats).items()]
    return metrics + (_step_metrics(read_metrics(manifest.path / METRICS_FILE)) if with_steps else [])


def numeric(stats: Mapping[str, Any]) -> dict[str, float]:
    """The values MLflow takes as metrics: finite numbers, not booleans."""
    return {k: float(v) for k, v in stats.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def dataset_name(stage: str, key: str) -> str:
    """The MLflow dataset an upstream artifact is in a stage run's lineage: `<stage>-<key>`."""
    return f"{stage}-{key}"


def artifact_input(name: str, manifest: Manifest, source_type: str, context: str) -> DatasetInput:
    """An artifact as an MLflow dataset input: digest = its key, source = its directory."""
    dataset = Dataset(name=name, digest=manifest.key, source_type=source_type,
                      source=manifest.path.resolve().as_uri())
    return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])


_EXPERIMENT_IDS: dict[str, str] = {}  # tracking URI -> the pipeline experiment's id, per process


def _artifact_location(home: Path) -> str | None:
    """Where the pipeline experiment keeps its artifacts: under GRISTMILL_HOME with the default
    store; beside the database when MLFLOW_TRACKING_URI names a SQLite file (MLflow itself would
    pick ./mlruns of whatever directory the run started in); a tracking server's own choice."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return env.mlflow_artifacts_root(home).as_uri()
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlruns").as_uri()
    return None


def _experiment_id(client: Client, home: Path) -> str:
    """The pipeline experiment's id, looked up (or created) once per process and store."""
    if client.uri not in _EXPERIMENT_IDS:
        experiment = client.get_experiment_by_name(EXPERIMENT)
        if experiment is None:
            _EXPERIMENT_IDS[client.uri] = client.create_experiment(EXPERIMENT,
                                                                   artifact_location=_artifact_location(home))
        else:
            _EXPERIMENT_IDS[client.uri] = experiment.experiment_id
    return _EXPERIMENT_IDS[client.uri]


class Tracker:
    """Parent and stage runs of one pipeline run, addressed by explicit run ids (thread-safe)."""

    def __init__(self, home: Path):
        self.uri = tracking_uri(home)
        self.client = Client(self.uri)
        self.experiment_id = _experiment_id(self.client, home)

    def start_pipeline(self, run_name: str, config: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name,
                                     tags={"gristmill.kind": "pipeline", **tags})  # tags may set the kind
        self._log_batches(run.info.run_id, params=_params(config))
        return run.info.run_id

    def start_stage(self, parent_id: str, stage: str, key: str, config: Mapping[str, Any],
                    upstream: Mapping[str, Manifest]) -> str:
        """The run of a stage about to compute: tags, params and lineage logged now, so that the
        UI shows them while it runs."""
        run_id = self._create_stage_run(parent_id, stage, key, upstream, None, {})
        self._log_batches(run_id, params=_params(config))
        self._log_lineage(run_id, upstream)
        return run_id

    @contextlib.contextmanager
    def follow_metrics(self, run_id: str, path: Path) -> Iterator[None]:
        """While inside, send the rows a computing stage appends to its metrics.jsonl (`path`:
        rank 0's, whichever process writes it) to its run every FOLLOW_EVERY_S, so the MLflow UI
        shows the curves as it trains; the rest when it ends. A file cut short (a resume or a
        rollback drops the steps it redoes) is followed from its new end. A new file in its place
        (rank 0's, from another node: flows/launch.py) is read from its start, for the steps after
        the last one sent."""
        offset, inode, last_step, stop = 0, None, -1, threading.Event()

        def send() -> None:
            nonlocal offset, inode, last_step
            if not path.is_file():
                return
            with path.open("rb") as handle:
                replaced = inode is not None and os.fstat(handle.fileno()).st_ino != inode
                inode = os.fstat(handle.fileno()).st_ino
                if replaced:
                    offset = 0
                if handle.seek(0, os.SEEK_END) < offset:
                    offset = handle.tell()
                handle.seek(offset)
                complete = handle.read().rpartition(b"\n")[0]  # a row being written waits its turn
            if complete:
                offset += len(complete) + 1
                rows = [json.loads(line) for line in complete.splitlines() if line.strip()]
                if replaced:
                    rows = [row for row in rows if int(row["step"]) > last_step]
                last_step = max([last_step, *(int(row["step"]) for row in rows)])
                self._log_batches(run_id, metrics=_step_metrics(rows))

        def follow() -> None:
            while not stop.wait(FOLLOW_EVERY_S):
                try:
                    send()
                except Exception as error:  # the final send, in the stage's thread, raises
                    log.warning("step metrics not sent yet: %s", error)

        follower = threading.Thread(target=follow, name="gristmill-follow-metrics", daemon=True)
        follower.start()
        try:
            yield
        finally:
            stop.set()
            follower.join()
            send()

    def finish_stage(self, run_id: str, manifest: Manifest, artifacts: Iterable[str]) -> None:
        """Log stats and small artifacts (the step metrics were followed while it computed:
        `follow_metrics`); close the run."""
        self._log_batches(run_id, metrics=_stage_metrics(manifest, with_steps=False),
                          tags=[RunTag("gristmill.artifact_dir", str(manifest.path))])
        self._log_files(run_id, manifest, artifacts)
        self.end(run_id, ok=True)

    def record_reused_stage(self, parent_id: str, stage: str, key: str, config: Mapping[str, Any],
                            upstream: Mapping[str, Manifest], manifest: Manifest,
                            wait_s: float = 0.0) -> tuple[str, bool]:
        """The run of a reused stage, in five MLflow calls: `get_run` asks whether the run that
        computed the artifact finished; `create_run` (with its tags), one `log_batch` (params and
        stats), `log_inputs` (lineage; none without upstreams) and `end` record it. It points at
        the computing run, which holds the step metrics, manifest, config and charts; when that
        run never finished (MLflow was lost mid-stage) this run back-fills them and is tagged
        `gristmill.backfilled`. `wait_s`: how long a computing run still running may take to
        finish (see `finished`). Returns (run id, whether it back-filled); the run is left open
        for the stage's publisher, closed by `end`."""
        backfill = not self.finished(manifest.meta.get("mlflow_run_id"), wait_s)
        extra = {"gristmill.artifact_dir": str(manifest.path),
                 **({"gristmill.backfilled": "true"} if backfill else {})}
        run_id = self._create_stage_run(parent_id, stage, key, upstream, manifest, extra)
        self._log_batches(run_id, params=_params(config), metrics=_stage_metrics(manifest, backfill))
        self._log_lineage(run_id, upstream)
        if backfill:
            self._log_files(run_id, manifest, [])
        return run_id, backfill

    def finished(self, run_id: str | None, wait_s: float = 0.0) -> bool:
        """Whether `run_id` exists and ended as FINISHED (a stage whose logging was cut short
        does not): one `get_run`. With `wait_s`, a run still RUNNING is asked again every
        FINISH_POLL_S until it ends or `wait_s` passed: a run that committed an artifact a moment
        ago logs its stats, files and publisher's output before it ends its run, and a run killed
        after its commit stays RUNNING for ever."""
        if not run_id:
            return False
        deadline = time.monotonic() + wait_s
        while True:
            try:
                status = self.client.get_run(run_id).info.status
            except MlflowException:  # no such run: a different tracking store, or a deleted run
                return False
            if status != RUNNING or time.monotonic() >= deadline:
                return status == FINISHED
            time.sleep(FINISH_POLL_S)

    def end(self, run_id: str, ok: bool) -> None:
        status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
        self.client.set_terminated(run_id, status=status)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        self._log_batches(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self.client.log_text(run_id, text, name)

    def log_file(self, run_id: str, path: Path, folder: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), folder)

    def log_metrics(self, run_id: str, metrics: Sequence[Metric]) -> None:
        self._log_batches(run_id, metrics=metrics)

    def log_inputs(self, run_id: str, inputs: list[DatasetInput], models: Sequence[LoggedModelInput] = (),
                   attempts: int = 3) -> None:
        """`log_inputs` of datasets and logged models, tried again when it fails. MLflow looks a
        dataset up and inserts it when missing in two steps, so two runs logging the same dataset
        at once (two runs of one config, the second reusing what the first computed) can both
        insert, and the later one fails on the unique (experiment, name, digest) constraint.
        The failed transaction changed nothing, and the next try finds the row the other run
        inserted."""
        for attempt in range(attempts):
            try:
                self.client.log_inputs(run_id, datasets=inputs, models=list(models))
                return
            except MlflowException:  # TrackingUnavailable (no answer) is not one: it propagates
                if attempt == attempts - 1:
                    raise
                time.sleep(0.1 * (attempt + 1))

    def _create_stage_run(self, parent_id: str, stage: str, key: str, upstream: Mapping[str, Manifest],
                          reused_from: Manifest | None, extra: Mapping[str, str]) -> str:
        tags = {"mlflow.parentRunId": parent_id, "gristmill.kind": "stage",
                "gristmill.stage": stage, "gristmill.key": key,
                "gristmill.reused": str(reused_from is not None).lower(), **extra}
        if reused_from is not None and reused_from.meta.get("mlflow_run_id"):
            tags["gristmill.source_run_id"] = reused_from.meta["mlflow_run_id"]
        for name, manifest in upstream.items():
            tags[f"gristmill.upstream.{name}.key"] = manifest.key
            if manifest.meta.get("mlflow_run_id"):
                tags[f"gristmill.upstream.{name}.run_id"] = manifest.meta["mlflow_run_id"]
        return self.client.create_run(self.experiment_id, run_name=stage, tags=tags).info.run_id

    def _log_lineage(self, run_id: str, upstream: Mapping[str, Manifest]) -> None:
        inputs = [artifact_input(dataset_name(name, m.key), m, "gristmill-artifact", f"upstream:{name}")
                  for name, m in upstream.items()]
        if inputs:
            self.log_inputs(run_id, inputs)

    def _log_files(self, run_id: str, manifest: Manifest, artifacts: Iterable[str]) -> None:
        for rel in [MANIFEST, CONFIG, *artifacts]:
            if (manifest.path / rel).is_file():
                self.client.log_artifact(run_id, str(manifest.path / rel))

    def _log_batches(self, run_id: str, params: Sequence[Param] = (), metrics: Sequence[Metric] = (),
                     tags: Sequence[RunTag] = ()) -> None:
        """Params, metrics and tags in as few log_batch calls as MLflow's limits allow (at most
        100 params and 1000 values in all per call)."""
        params, metrics, tags = list(params), list(metrics), list(tags)
        while params or metrics or tags:
            batch_params, params = params[:PARAMS_PER_BATCH], params[PARAMS_PER_BATCH:]
            batch_tags, tags = tags[:PARAMS_PER_BATCH], tags[PARAMS_PER_BATCH:]
            room = BATCH - len(batch_params) - len(batch_tags)
            batch_metrics, metrics = metrics[:room], metrics[room:]
            self.client.log_batch(run_id, metrics=batch_metrics, params=batch_params, tags=batch_tags)


class RunRecord(dict):
    """A finished run as plain data: run_id, name, start_time (ms), status, params, metrics
    (latest value of each), tags."""


def _record(run: Any) -> RunRecord:
    return RunRecord(run_id=run.info.run_id, name=run.info.run_name, start_time=run.info.start_time,
                     status=run.info.status, params=dict(run.data.params),
                     metrics=dict(run.data.metrics), tags=dict(run.data.tags))


def pipeline_run(tracker: Tracker, run: str | None = None) -> RunRecord:
    """A pipeline's parent run by id or by name, or the latest one when `run` is None;
    LookupError naming what was asked when there is none."""
    kind = "tags.`gristmill.kind` = 'pipeline'"
    if run is None:
        found = tracker.client.search_runs([tracker.experiment_id], kind, max_results=1,
                                           order_by=["attributes.start_time DESC"])
    else:
        try:
            return _record(tracker.client.get_run(run))
        except MlflowException:  # not a run id: a run name
            escaped = run.replace("'", "\\'")
            found = tracker.client.search_runs([tracker.experiment_id],
                                               f"{kind} and attributes.run_name = '{escaped}'",
                                               max_results=1, order_by=["attributes.start_time DESC"])
    if not found:
        raise LookupError(f"no pipeline run {run!r} in {tracker.uri}" if run else
                          f"no pipeline run in {tracker.uri} yet; run `gristmill run CONFIG` first")
    return _record(found[0])


def stage_runs_of(tracker: Tracker, parent_id: str) -> list[RunRecord]:
    """The stage runs of one pipeline run, in the order they started."""
    runs = tracker.client.search_runs([tracker.experiment_id],
                                      f"tags.`mlflow.parentRunId` = '{parent_id}'",
                                      order_by=["attributes.start_time ASC"])
    return [_record(r) for r in runs]


def stage_runs(uri: str, stage: str) -> list:
    """Every MLflow run of one stage, newest first (for checks and tools)."""
    client = Client(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([experiment.experiment_id], f"tags.`gristmill.stage` = '{stage}'") \
        if experiment else []
