"""MLflow tracking: the only module that imports mlflow.

One parent run per pipeline run and one child run per stage (also for reused stages, tagged
`gristmill.reused=true` and pointing at the run that computed the artifact). A stage run carries
its resolved config as params, its stats and step-wise metrics, small artifacts, and its lineage:
each upstream artifact as an MLflow dataset input (digest = artifact key, source = its directory)
plus a tag naming the upstream stage's run.

Uses `MLFLOW_TRACKING_URI` when set, else a SQLite store under GRISTMILL_HOME.

When a tracking server stops answering (after MLflow's own retries, about four minutes by
default: `MLFLOW_HTTP_REQUEST_MAX_RETRIES`), the run fails with one `TrackingUnavailable` line
rather than carrying on untracked. Nothing computed is lost: a stage's metrics live in its
artifact (metrics.jsonl, manifest stats), and the next run that reuses a stage whose computing
MLflow run never finished logs them into its own stage run (tagged `gristmill.backfilled`).
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from mlflow.entities import (
    Dataset,
    DatasetInput,
    InputTag,
    Metric,
    Param,
    RunStatus,
    RunTag,
)
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from core.stage import METRICS_FILE, Manifest, read_metrics
from infra import env
from infra.artifacts import CONFIG, MANIFEST

EXPERIMENT = "gristmill"
MAX_PARAM_CHARS = 6000  # MLflow's limit on one param value
BATCH = 900  # MLflow accepts at most 1000 values (metrics + params + tags) per log_batch
PARAMS_PER_BATCH = 100  # and at most 100 params (and 100 tags) of them


def tracking_uri(home: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or env.mlflow_store_uri(home)


def is_server(uri: str) -> bool:
    """A tracking server (its UI can be linked; it takes concurrent writers), not a local store."""
    return uri.startswith(("http://", "https://"))


def migrate_sqlite_store(db: Path) -> None:
    """Create MLflow's tables in a new SQLite file and migrate them to this MLflow's revision:
    what its store does on first open, before it adds the Default experiment."""
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    engine = sqlalchemy.create_engine(f"sqlite:///{db}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()


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


def _stage_metrics(manifest: Manifest, with_steps: bool) -> list[Metric]:
    """The manifest's numeric stats (step 0) and, when `with_steps`, its metrics.jsonl rows."""
    stamp = _now_ms()
    metrics = [Metric(k, v, stamp, 0) for k, v in _numeric(manifest.stats).items()]
    if with_steps:
        for row in read_metrics(manifest.path / METRICS_FILE):
            metrics += [Metric(k, v, stamp, int(row["step"])) for k, v in _numeric(row).items() if k != "step"]
    return metrics


def _numeric(stats: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in stats.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def stage_runs(uri: str, stage: str) -> list:
    """Every MLflow run of one stage, newest first (for checks and tools)."""
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([experiment.experiment_id], f"tags.`gristmill.stage` = '{stage}'") \
        if experiment else []


@dataclass(frozen=True)
class ModelVersion:
    """One version of a registered model, as plain data: its number, tags and aliases."""

    name: str
    version: str
    tags: dict[str, str]
    aliases: tuple[str, ...]


def _version(mv: Any) -> ModelVersion:
    return ModelVersion(mv.name, str(mv.version), dict(mv.tags or {}), tuple(mv.aliases or ()))


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server did not answer."""


class _Guarded:
    """An MlflowClient whose connection failures become one clear TrackingUnavailable."""

    def __init__(self, client: MlflowClient, uri: str):
        self._client, self._uri = client, uri

    def __getattr__(self, name: str):
        method = getattr(self._client, name)

        @functools.wraps(method)
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except MlflowException as error:
                if "API request to" not in str(error):  # MLflow's words for "no answer"
                    raise
                raise TrackingUnavailable(
                    f"MLflow at {self._uri} is not answering ({name}); the stages finished so far "
                    "are kept and the next run logs them to MLflow") from error

        return call


FINISHED_LEDGER = "mlflow-finished-runs.tsv"  # in GRISTMILL_HOME: tracking URI, run id
_EXPERIMENT_IDS: dict[str, str] = {}  # tracking URI -> the pipeline experiment's id, per process


class Tracker:
    """Parent and stage runs of one pipeline run, addressed by explicit run ids (thread-safe)."""

    def __init__(self, home: Path):
        self.uri = tracking_uri(home)
        self.client = _Guarded(MlflowClient(self.uri), self.uri)
        self.ledger = Path(home) / FINISHED_LEDGER
        if self.uri not in _EXPERIMENT_IDS:  # once per process and store
            experiment = self.client.get_experiment_by_name(EXPERIMENT)
            if experiment is None:
                # With the default SQLite store, keep artifacts under GRISTMILL_HOME, not the cwd.
                location = None if os.environ.get("MLFLOW_TRACKING_URI") else \
                    env.mlflow_artifacts_root(home).as_uri()
                _EXPERIMENT_IDS[self.uri] = self.client.create_experiment(EXPERIMENT, artifact_location=location)
            else:
                _EXPERIMENT_IDS[self.uri] = experiment.experiment_id
        self.experiment_id = _EXPERIMENT_IDS[self.uri]

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

    def finish_stage(self, run_id: str, manifest: Manifest, artifacts: Iterable[str],
                     replay_metrics: bool) -> None:
        """Log stats, step metrics (when the stage ran here) and small artifacts; close the run."""
        self._log_batches(run_id, metrics=_stage_metrics(manifest, replay_metrics),
                          tags=[RunTag("gristmill.artifact_dir", str(manifest.path))])
        self._log_files(run_id, manifest, artifacts)
        self.end(run_id, ok=True)

    def record_reused_stage(self, parent_id: str, stage: str, key: str, config: Mapping[str, Any],
                            upstream: Mapping[str, Manifest], manifest: Manifest) -> tuple[str, bool]:
        """The run of a reused stage: one call to ask whether the run that computed the artifact
        finished, then four to record it (created with its tags, params and stats in one batch,
        lineage, end). It points at the run that computed the artifact, which holds the
        step metrics, manifest, config and charts; when that run never finished (MLflow was lost
        mid-stage) this run back-fills them and is tagged `gristmill.backfilled`. Returns (run id,
        whether it back-filled); the run is left open for the stage's publisher, closed by `end`."""
        backfill = not self.finished(manifest.meta.get("mlflow_run_id"))
        extra = {"gristmill.artifact_dir": str(manifest.path), **({"gristmill.backfilled": "true"}
                                                                  if backfill else {})}
        run_id = self._create_stage_run(parent_id, stage, key, upstream, manifest, extra)
        self._log_batches(run_id, params=_params(config), metrics=_stage_metrics(manifest, backfill))
        self._log_lineage(run_id, upstream)
        if backfill:
            self._log_files(run_id, manifest, [])
        return run_id, backfill

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

    def finished(self, run_id: str | None) -> bool:
        """Whether `run_id` exists and ended as FINISHED (a stage whose logging was cut short
        does not). A run ended here is in the home's ledger of finished runs of this store, which
        saves asking MLflow (a `get_run` parses the run's params, metrics and tags: ~0.05 s a
        reused stage); any other is looked up once."""
        if not run_id:
            return False
        if run_id in self._ledger():
            return True
        try:
            done = self.client.get_run(run_id).info.status == RunStatus.to_string(RunStatus.FINISHED)
        except TrackingUnavailable:
            raise
        except MlflowException:  # no such run: a different tracking store, or a deleted run
            return False
        if done:
            self._note_finished(run_id)
        return done

    def end(self, run_id: str, ok: bool) -> None:
        status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
        self.client.set_terminated(run_id, status=status)
        if ok:
            self._note_finished(run_id)

    def _ledger(self) -> set[str]:
        """Run ids this home saw finish in this tracking store (a FINISHED run stays finished)."""
        try:
            lines = self.ledger.read_text().splitlines()
        except FileNotFoundError:
            return set()
        return {run for uri, _, run in (line.partition("\t") for line in lines) if uri == self.uri}

    def _note_finished(self, run_id: str) -> None:
        # One short append per line: concurrent runs' lines do not interleave (O_APPEND).
        with self.ledger.open("a") as ledger:
            ledger.write(f"{self.uri}\t{run_id}\n")

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        self._log_batches(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self.client.log_text(run_id, text, name)

    def log_file(self, run_id: str, path: Path, folder: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), folder)

    # --- the model registry: versions and aliases (registry "stages" are deprecated; never used) ---

    def register_model(self, name: str, run_id: str, model_dir: Path, tags: Mapping[str, str]) -> ModelVersion:
        """Log `model_dir` into run `run_id` as its `model/` artifact and register that as a new
        version of `name` (the registered model is created on first use). A plain HF directory,
        not an MLflow flavor: `mlflow.artifacts.download_artifacts("models:/NAME@champion")` fetches it."""
        self.client.log_artifacts(run_id, str(model_dir), "model")
        try:
            self.client.create_registered_model(name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        return _version(self.client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id,
                                                         tags=dict(tags)))

    def model_versions(self, name: str) -> list[ModelVersion]:
        """Every version of registered model `name`, oldest first (none when it does not exist);
        their `aliases` are empty: a search does not return them (use version_by_alias)."""
        escaped = name.replace("'", "\\'")
        found = self.client.search_model_versions(f"name = '{escaped}'")
        return sorted((_version(mv) for mv in found), key=lambda v: int(v.version))

    def version_by_alias(self, name: str, alias: str) -> ModelVersion | None:
        """The version `alias` points at; None when the model or the alias does not exist."""
        try:
            return _version(self.client.get_model_version_by_alias(name, alias))
        except TrackingUnavailable:
            raise
        except MlflowException as error:
            if error.error_code not in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):
                raise
            return None

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, version)

    def set_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        self.client.set_model_version_tag(name, version, key, value)

    def log_corpus_version(self, run_id: str, version: int, manifest: Manifest,
                           parent: tuple[int, Manifest] | None) -> None:
        """A data refresh's lineage: the corpus version it published (dataset `corpus-v<N>`,
        context `corpus-version`) and the version it extends (context `parent-corpus-version`),
        each with digest = its collect artifact key, plus tags naming both."""
        versions = [(version, manifest, "corpus-version")]
        if parent is not None:
            versions.append((*parent, "parent-corpus-version"))
        self._log_inputs(run_id, [
            DatasetInput(Dataset(name=f"corpus-v{n}", digest=m.key, source_type="gristmill-corpus",
                                 source=m.path.resolve().as_uri()),
                         tags=[InputTag("mlflow.data.context", context)])
            for n, m, context in versions])
        tags = {"gristmill.corpus.version": str(version), "gristmill.corpus.key": manifest.key,
                "gristmill.corpus.parent_version": str(parent[0]) if parent else "none"}
        self.set_tags(run_id, tags)

    def _log_lineage(self, run_id: str, upstream: Mapping[str, Manifest]) -> None:
        inputs = [
            DatasetInput(
                Dataset(name=f"{name}-{m.key}", digest=m.key, source_type="gristmill-artifact",
                        source=m.path.resolve().as_uri()),
                tags=[InputTag("mlflow.data.context", f"upstream:{name}")],
            )
            for name, m in upstream.items()
        ]
        if inputs:
            self._log_inputs(run_id, inputs)

    def _log_inputs(self, run_id: str, inputs: list[DatasetInput], attempts: int = 3) -> None:
        """`log_inputs`, tried again when it fails. MLflow looks a dataset up and inserts it when
        missing in two steps, so two runs logging the same dataset at once (two runs of one config,
        the second reusing what the first computed) can both insert, and the later one fails on the
        unique (experiment, name, digest) constraint. The failed transaction changed nothing, and
        the next try finds the row the other run inserted."""
        for attempt in range(attempts):
            try:
                self.client.log_inputs(run_id, datasets=inputs)
                return
            except MlflowException:  # TrackingUnavailable (no answer) is not one: it propagates
                if attempt == attempts - 1:
                    raise
                time.sleep(0.1 * (attempt + 1))


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
        except MlflowException:
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
