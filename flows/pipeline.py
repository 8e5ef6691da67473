"""The Prefect flow `pipeline`: six stage tasks in one DAG, passing manifests only.

Each task materializes one stage through the artifact store (reuse when its key is complete,
otherwise compute into the `.partial` dir and commit) inside an MLflow child run. Between collect
and tokenize the data gates (flows/gates.py) decide whether the run may go on with the collected
data. Run it with `gristmill run CONFIG`, or from the Prefect UI once served.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.context import TaskRunContext
from prefect.runtime import flow_run
from prefect.states import Failed

from gristmill.core.stage import METRICS_FILE, Manifest, SerialEngine
from gristmill.flows.config import PipelineConfig, with_overrides
from gristmill.flows.dag import PlannedStage, launch_problems_of, manifest_fields, open_store, plan, run_planned
from gristmill.flows.explain import explain
from gristmill.flows.gates import GateDecision, GatesRejected, GatesStopped, enforce
from gristmill.flows.history import publish_report_card
from gristmill.flows.launch import launched
from gristmill.flows.notify import notify, rollbacks
from gristmill.flows.progress import stage_progress
from gristmill.flows.registry import Decision, register_and_promote
from gristmill.flows.report_card import Section, registry_section
from gristmill.flows.stages import COLLECT, EVALUATE
from gristmill.infra import env
from gristmill.infra.artifacts import ArtifactStore
from gristmill.infra.interrupt import stop_if_interrupted
from gristmill.infra.memory import PeakRSS
from gristmill.infra.tracking import is_server
from gristmill.infra.tracking.runs import Tracker

if TYPE_CHECKING:
    from gristmill.infra.ray_engine import RayEngine

GPU_LIMIT = "gpu"  # the Prefect global concurrency limit GPU stages take a slot of
RECORD_THREADS = 3  # reused stages recorded at once (each mostly waits on the tracking server)
# A stage another run committed while this one waited: that run still logs its stats, files and
# publisher's output before it ends its MLflow run (seconds; more on a loaded machine). Waited for
# up to this long, so that its reuse points at the finished run instead of back-filling a copy.
SOURCE_FINISH_WAIT_S = 60.0


class Runtime:
    """The edges a run talks to: artifact store and tracker, and the run's config (built once per flow run). With
    `background`, a reused stage's MLflow run is recorded on a thread while the flow moves on to
    the next stage (each record waits on the tracking server; a fully reused run overlaps them);
    `join` waits for them all and raises the first failure. `ray_stages`: the stages of the run
    that compute on Ray, in order; each but the last leaves its local Ray to the next
    (infra/ray_engine.py), and `release_ray` stops one that none took over."""

    def __init__(self, store: ArtifactStore, tracker: Tracker, parent_run_id: str, config: PipelineConfig,
                 background: bool = False, ray_stages: Sequence[str] = ()):
        self.config = config  # what a launched stage's ranks plan from
        self.ray_stages = list(ray_stages)
        self.store = store
        self.tracker = tracker
        self.parent_run_id = parent_run_id
        self._pool = ThreadPoolExecutor(RECORD_THREADS, "gristmill-record") if background else None
        self._records: dict[str, Future] = {}
        # stage -> "computed" | "reused", as the store decided when the stage ran: a stage planned
        # to run is reused when another run computed its key meanwhile
        self.outcomes: dict[str, str] = {}

    def record(self, name: str, after: Iterable[str], fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)`, the record of stage `name`, once the records of the stages `after` are done:
        a publisher finds what its upstream stages' publishers logged (the evaluate stage's scores
        are logged against the models the SFT and align records log). No wait can deadlock: the
        pool takes records in the order they come, upstream stages' first."""
        if self._pool is None:
            fn(*args)
            return
        upstream = [self._records[u] for u in after if u in self._records]

        def in_order() -> None:
            for future in upstream:
                future.result()
            fn(*args)

        self._records[name] = self._pool.submit(in_order)

    def join(self) -> None:
        records, self._records = self._records, {}
        for future in records.values():
            future.result()

    def keeps_ray_after(self, name: str) -> bool:
        """Whether stage `name` leaves its local Ray running: a later stage of this run computes on Ray."""
        return name in self.ray_stages[:-1]

    @staticmethod
    def release_ray() -> None:
        """Stop a local Ray a stage left running for a later one that did not take it over (that
        stage was reused after all, or the run stops)."""
        ray_engine = sys.modules.get("gristmill.infra.ray_engine")  # none was kept unless a stage ran on Ray
        if ray_engine is not None:
            ray_engine.release_local()

    def abandon(self) -> None:
        """The run is failing or stopping: drop the records not started, wait for none."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _engine(stage: PlannedStage, store: ArtifactStore) -> SerialEngine | RayEngine:
    if not stage.spec.uses_ray:
        return SerialEngine()
    from gristmill.infra.ray_engine import (
        RayEngine,  # imported lazily: only data stages pay Ray's start-up
    )

    # with the store on a bucket, workers write there: Ray's nodes need not share a disk
    return RayEngine(num_workers=stage.ray_workers,
                     worker_dirs=store.remote_location if store.remote is not None else None)


def _compute(stage: PlannedStage, upstream: Mapping[str, Manifest], runtime: Runtime, runs: list[str],
             artifacts: list[str], meta: Mapping[str, Any], why: list[str] | None):
    """The store's compute callback: start the stage's MLflow run (appended to `runs`), run the
    stage into its partial dir (in this process, or in the processes its `launch` section asks
    for), return the manifest fields. Called only once this run holds the key's lock and no other
    run committed it, so a stage that ends up reused has no computing run and no `why` artifact."""
    launch = stage.launch
    name = stage.spec.name

    def compute(partial_dir) -> dict[str, Any]:
        run_id = runtime.tracker.start_stage(runtime.parent_run_id, name, stage.key,
                                             stage.config.model_dump(mode="json"), upstream)
        runs.append(run_id)
        _say_why(name, stage.key, why)
        # the stage's memory, its Ray workers' and launched ranks' included; its progress on the
        # console and as the Prefect artifact progress-<stage> (flows/progress.py)
        with PeakRSS() as peak, runtime.tracker.follow_metrics(run_id, partial_dir / METRICS_FILE), \
                stage_progress(stage.spec.name):
            if launch is not None and launch.backend != "inline":
                result = launched(stage, runtime.config, partial_dir, get_run_logger(), runtime.store)
            else:
                engine = _engine(stage, runtime.store)
                try:
                    result = run_planned(stage, upstream, partial_dir, engine=engine,
                                         store_mapping=runtime.store.store_mapping)
                except BaseException:
                    _stop(engine, keep_ray=False)
                    raise
                _stop(engine, keep_ray=runtime.keeps_ray_after(name))
                # where a Ray engine's work units ran: {map: {node id: units}}, a multi-node run's record
                if units_per_node := getattr(engine, "units_per_node", None):
                    result.stats["units_per_node"] = units_per_node
                if retried := getattr(engine, "store_retries", 0):  # its workers'; the store adds this process's
                    result.stats["store_retries"] = retried
        artifacts.extend(result.artifacts)
        # the whole tree's peak, this process's (a data stage's driver) and the largest other one's
        # (a Ray worker or launched rank, or Ray's own services)
        result.stats.update(peak_rss_mb=peak.mb, driver_peak_rss_mb=peak.own_mb, worker_peak_rss_mb=peak.child_mb)
        return manifest_fields(stage, upstream, result, {
            "mlflow_run_id": run_id, "prefect_flow_run_id": str(flow_run.id), **meta,
            **({"launch": launch.record()} if launch is not None else {})})

    return compute


def _stop(engine: SerialEngine | RayEngine, keep_ray: bool) -> None:
    """Stop a Ray engine's actors, and its local Ray unless `keep_ray` (a later stage takes it over)."""
    if not isinstance(engine, SerialEngine):
        engine.shutdown(keep_local=keep_ray)


def _say_why(name: str, key: str, why: list[str] | None) -> None:
    get_run_logger().info("%s: computing %s-%s", name, name, key)
    if why:
        get_run_logger().info("%s: why it computes: %s", name, "; ".join(why))
        create_markdown_artifact(f"### Why {name} computes\n\n" + "".join(f"- {line}\n" for line in why),
                                 key=f"why-{name}", description=f"What differs from the nearest {name} artifact")


def _gpu_slot(stage: PlannedStage):
    """A training or evaluation stage computes holding one slot of the Prefect global concurrency
    limit `gpu` when the server has one (`prefect gcl create gpu --limit 1`: runs sharing the GPUs
    take turns, the data stages still overlap); without that limit nothing waits."""
    if not stage.spec.uses_gpu:
        return contextlib.nullcontext()
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:  # asked first: Prefect would warn in every GPU stage's log that the limit is missing
            client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            return contextlib.nullcontext()
    return concurrency(GPU_LIMIT, occupy=1, strict=True)


def _publish(stage: PlannedStage, manifest: Manifest, runtime: Runtime, run_id: str, owner: bool) -> None:
    if (publisher := stage.spec.load_publisher()) is not None:
        publisher(manifest, runtime.tracker, run_id, owner)


def _record_reused(stage: PlannedStage, config: dict[str, Any], upstream: dict[str, Manifest],
                   existing: Manifest, runtime: Runtime, wait_s: float = 0.0) -> None:
    name, tracker = stage.spec.name, runtime.tracker
    run_id, backfilled = tracker.record_reused_stage(runtime.parent_run_id, name, stage.key,
                                                     config, upstream, existing, wait_s)
    try:
        # What a publisher logs lives in the run that computed the artifact, unless it never finished.
        _publish(stage, existing, runtime, run_id if backfilled else existing.meta["mlflow_run_id"],
                 owner=backfilled)
    except BaseException:
        tracker.end(run_id, ok=False)
        raise
    tracker.end(run_id, ok=True)


def _reused(stage: PlannedStage, upstream: dict[str, Manifest], manifest: Manifest, runtime: Runtime,
            wait_s: float = 0.0) -> Manifest:
    """Record a stage this run did not compute: an MLflow run tagged `gristmill.reused` pointing at
    the run that computed it (`gristmill.source_run_id`), and the outcome for the run's summary.
    `wait_s`: how long the computing run may take to end its MLflow run before this one back-fills it."""
    runtime.outcomes[stage.spec.name] = "reused"
    runtime.record(stage.spec.name, upstream, _record_reused, stage, stage.config.model_dump(mode="json"),
                   upstream, manifest, runtime, wait_s)
    return manifest


def _rename_task_run(name: str) -> None:
    """The task run was named for the plan (`<stage> [run]`); another run computed the stage
    meanwhile, so the name the Prefect UI lists says what happened. Prefect records a task run
    from its state events, which carry its name: renamed here, the run's final state brings the new
    name (the server may not know the task run yet, so renaming it through the API can miss)."""
    if (context := TaskRunContext.get()) is not None:
        context.task_run.name = name


@task(cache_policy=NO_CACHE)
def run_stage(stage: PlannedStage, upstream: dict[str, Manifest], runtime: Runtime,
              meta: dict[str, Any] | None = None, why: list[str] | None = None) -> Manifest:
    """Reuse or compute one stage; `upstream` carries the manifests this stage depends on, `meta`
    extra fields for a computed manifest's meta (a data refresh's corpus version), `why` what
    differs from the nearest artifact of the stage (flows/explain.py), logged when it computes.
    Whether it was reused or computed is what the store did (`runtime.outcomes`), not the plan."""
    logger = get_run_logger()
    name, tracker = stage.spec.name, runtime.tracker
    stop_if_interrupted(f"stage {name}")
    if not stage.spec.uses_ray:  # a local Ray kept for a later Ray stage is not held through other work
        runtime.release_ray()
    if (existing := runtime.store.load(name, stage.key)) is not None:
        logger.info("%s: reused %s (computed by MLflow run %s)", name, existing.path,
                    existing.meta.get("mlflow_run_id"))
        return _reused(stage, upstream, existing, runtime)
    runs: list[str] = []  # the stage's MLflow run, started once this run computes it
    try:
        artifacts: list[str] = []
        with _gpu_slot(stage):
            manifest, reused = runtime.store.materialize(
                name, stage.key, _compute(stage, upstream, runtime, runs, artifacts, meta or {}, why))
        if reused:
            logger.info("%s: reused %s, computed meanwhile by another run (MLflow run %s)", name,
                        manifest.path, manifest.meta.get("mlflow_run_id"))
            _rename_task_run(f"{name} [reuse]")
            return _reused(stage, upstream, manifest, runtime, wait_s=SOURCE_FINISH_WAIT_S)
        if not runs:  # an earlier run's output, committed now: it was killed in its commit window
            runs.append(tracker.start_stage(runtime.parent_run_id, name, stage.key,
                                            stage.config.model_dump(mode="json"), upstream))
        runtime.outcomes[name] = "computed"
        runtime.join()  # reused upstream stages recorded first: a publisher finds what they logged
        _publish(stage, manifest, runtime, runs[0], owner=True)
        tracker.finish_stage(runs[0], manifest, artifacts)
        logger.info("%s: done in %.1f s -> %s", name, manifest.meta.get("seconds", 0), manifest.path)
        return manifest
    except BaseException:
        if runs:
            tracker.end(runs[0], ok=False)
        raise


def start_parent_run(tracker: Tracker, run_name: str, config: PipelineConfig, kind: str) -> str:
    """The MLflow run of this flow run (`gristmill.kind` = kind): the config as params, except
    `notify`, which names where a secret is kept."""
    return tracker.start_pipeline(run_name, config.model_dump(mode="json", exclude={"notify"}),
                                  {"gristmill.kind": kind, "prefect.flow_run_id": str(flow_run.id),
                                   "gristmill.code_version": env.code_version()})


def _summary(planned: list[PlannedStage], manifests: Mapping[str, Manifest], outcomes: Mapping[str, str]) -> str:
    rows = ["| stage | key | status | seconds | artifact |", "|---|---|---|---|---|"]
    for stage in planned:
        m = manifests[stage.spec.name]
        rows.append(f"| {stage.spec.name} | {stage.key} | {outcomes[stage.spec.name]} | "
                    f"{m.meta.get('seconds', '')} | {m.path} |")
    return "\n".join(rows)


def _report_card(tracker: Tracker, parent: str, run_name: str, planned: list[PlannedStage],
                 manifests: Mapping[str, Manifest], outcomes: Mapping[str, str], extra: list[Section]) -> None:
    """The run's report card, from the stages it has, in MLflow and as the `report-card` artifact."""
    statuses = {s.spec.name: outcomes[s.spec.name] for s in planned if s.spec.name in manifests}
    card, _ = publish_report_card(tracker, env.gristmill_home(), parent, run_name, manifests, statuses, extra)
    create_markdown_artifact(card.read_text(), key="report-card",
                             description="base → SFT → aligned, curves, funnel, time, lineage")


@flow(name="pipeline")
def pipeline(config: PipelineConfig = PipelineConfig(), until: str | None = None,
             overrides: list[str] | None = None, approve_gates: bool = False) -> dict[str, str] | State:
    """Run the DAG (up to and including `until`); returns stage -> artifact directory.
    `overrides` are `key=value` settings applied to `config` (free-form, as on the command line);
    `approve_gates`: go on when a data gate trips (collect.gates), without asking (flows/gates.py)."""
    logger = get_run_logger()
    config = with_overrides(config, overrides or [])
    home = env.gristmill_home()
    store = open_store(config, home)
    planned = plan(config, store, until)
    if problems := launch_problems_of(planned):
        raise ValueError("; ".join(problems))
    for stage in planned:
        logger.info("plan: %-8s %s  %s", stage.spec.name, stage.key,
                    "reuse" if stage.complete else "run")
    tracker = Tracker(home)
    run_name = f"{config.name} {flow_run.name}"
    parent = start_parent_run(tracker, run_name, config, "pipeline")
    if is_server(tracker.uri):
        create_link_artifact(f"{tracker.uri.rstrip('/')}/#/experiments/{tracker.experiment_id}/runs/"
                             f"{parent}", link_text=f"MLflow run {run_name}", key="mlflow-run",
                             description="The MLflow parent run: params, stage runs, metrics, lineage")
    # Against a tracking server, reused stages are recorded side by side; an SQLite store takes
    # one writer at a time, and threads would only queue on its lock (measured slower).
    runtime = Runtime(store, tracker, parent, config, background=is_server(tracker.uri),
                      ray_stages=[s.spec.name for s in planned if s.spec.uses_ray and not s.complete])
    manifests: dict[str, Manifest] = {}
    decision: Decision | None = None
    gates: GateDecision | None = None
    run = {"mlflow_run_id": parent, "name": run_name, "prefect_flow_run_id": str(flow_run.id)}
    try:
        reasons = explain(planned, store)
    except Exception as error:  # advisory: a store it cannot read must not fail the run
        logger.warning("could not say why stages run: %s", error)
        reasons = {}
    try:
        for stage in planned:
            status = "reuse" if stage.complete else "run"
            upstream = {name: manifests[name] for name in stage.spec.upstream}
            manifests[stage.spec.name] = run_stage.with_options(
                task_run_name=f"{stage.spec.name} [{status}]")(stage, upstream, runtime,
                                                               why=reasons.get(stage.spec.name))
            if stage.spec.name == COLLECT.name:  # the data gates: before anything is trained on it
                gates = enforce(manifests[COLLECT.name], config.section(COLLECT).gates, config.refresh.bytes_per_token,
                                store, tracker, parent, approve_gates)
            computed = runtime.outcomes[stage.spec.name] == "computed"
            if computed and (rows := rollbacks(manifests[stage.spec.name])):
                notify(config.notify, "training.rollback", run, {"stage": stage.spec.name,
                                                                 "rollbacks": rows})
        runtime.join()
        if config.registry.enabled and EVALUATE.name in manifests:
            decision = register_and_promote(config, tracker, parent, manifests)
            logger.info("registry: %s", decision.markdown())
    except Exception as error:
        runtime.abandon()
        if isinstance(error, GatesRejected):  # the card says why, with the data it was about
            _report_card(tracker, parent, run_name, planned, manifests, runtime.outcomes,
                             [error.decision.section()])
        tracker.end(parent, ok=False)
        failed = "collect (data gates)" if isinstance(error, (GatesStopped, GatesRejected)) else \
            next((s.spec.name for s in planned if s.spec.name not in manifests), None)
        notify(config.notify, "run.failed", run, {"stage": failed,
                                                  "error": f"{type(error).__name__}: {error}"[:2000]})
        if isinstance(error, (GatesStopped, GatesRejected)):  # a decision, not a crash: no traceback
            return Failed(message=str(error), data=error)
        raise
    except BaseException:  # Ctrl-C, SIGTERM: the user stopped it, nothing to report
        runtime.abandon()
        tracker.end(parent, ok=False)
        raise
    finally:
        runtime.release_ray()
    tripped = gates if gates is not None and gates.outcome != "passed" else None
    summary = _summary(planned, manifests, runtime.outcomes) + (f"\n\n{tripped.markdown()}" if tripped else "") + \
        (f"\n\n{decision.markdown()}" if decision else "")
    logging.getLogger("gristmill").info("pipeline summary\n%s", summary)
    create_markdown_artifact(summary, key="pipeline-summary", description="Stages reused or computed")
    tracker.log_text(parent, summary, "summary.md")
    extra = ([tripped.section()] if tripped else []) + ([registry_section(decision.markdown())] if decision else [])
    _report_card(tracker, parent, run_name, planned, manifests, runtime.outcomes, extra)
    tracker.end(parent, ok=True)
    return {name: str(m.path) for name, m in manifests.items()}
