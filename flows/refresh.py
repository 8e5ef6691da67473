"""The `data-refresh` flow: what is new in the collect sources becomes the next corpus version.

    gristmill refresh configs/tiny.yaml 'collect.sources=[/data/crawl]'     # once (cron users, tests)
    gristmill serve configs/tiny.yaml --refresh-cron "0 3 * * 1"           # served, on a schedule

A refresh
1. lists what the configured collect sources hold now: each file of a file, directory or glob
   source, stamped with its filesystem's version key (size, mtime... locally; ETag... on object
   stores), and each chosen file of a `cc:` source (a Common Crawl file never changes);
2. compares that with the inputs of every published corpus version (the chain kept by the
   artifact store, infra/artifacts.py): an input is new when no version holds it with that stamp.
   Nothing new: it says so and ends, in seconds;
3. runs the collect stage (flows/pipeline.run_stage: artifact store, MLflow child run) on only the
   new inputs with `dedup_index_from` = the latest version's collect artifact, so a document that
   near-duplicates anything collected before is removed, and the new index covers all versions;
   then checks its data gates (flows/gates.py) as a pipeline run does: a gate that trips waits for
   a person (or `--approve-gates`), and a rejected version is not published;
4. publishes version N+1: its collect manifest's meta has `corpus_version` and `parent_version`,
   the chain records it with its inputs, and its MLflow run (tag gristmill.kind=refresh) has it as
   dataset `corpus-v<N+1>` and the parent as `corpus-v<N>` (lineage);
5. when the version's clean tokens (estimated from its bytes, `refresh.bytes_per_token`) reach
   `refresh.min_new_tokens`, starts the `pipeline` deployment on the union of all versions
   (collect.sources = every version's clean docs/, already deduplicated against each other);
   otherwise it says why not, with the command that would start that run by hand.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, cast

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import FlowRun, State
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from prefect.states import Failed

from gristmill.core.sources import filesystem, parse_source, source_files
from gristmill.core.stage import Manifest
from gristmill.flows.config import PipelineConfig
from gristmill.flows.dag import plan
from gristmill.flows.gates import GatesRejected, GatesStopped, enforce
from gristmill.flows.pipeline import Runtime, run_stage, start_parent_run
from gristmill.flows.stages import COLLECT
from gristmill.infra import env
from gristmill.infra.artifacts import CORPUS, ArtifactStore, home_store
from gristmill.infra.tracking.corpus import log_corpus_version
from gristmill.infra.tracking.runs import Tracker
from gristmill.tasks.collect.config import Config as CollectConfig
from gristmill.tasks.collect.config import NothingSurvived
from gristmill.tasks.collect.read.common_crawl import CommonCrawlSource, list_files
from gristmill.tasks.collect.read.readers import SUPPORTED_SUFFIXES

DEPLOYMENT = "data-refresh"
CC_STAMP = "cc"  # a Common Crawl file is immutable: its URL is its identity


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one refresh did, as plain data (the flow's return value and its Markdown)."""

    version: int | None  # the latest corpus version after this refresh (None: there is none)
    new_inputs: int
    published: bool  # whether this refresh published `version`
    parent_version: int | None = None
    collect_dir: str | None = None
    new_docs: int = 0
    new_tokens: int = 0  # estimated: clean bytes / refresh.bytes_per_token
    pipeline_run: str | None = None  # the flow run id of the started pipeline
    reason: str = ""  # why the pipeline was or was not started
    gates: str = ""  # the data gates' outcome (and who approved)

    def markdown(self) -> str:
        if not self.published:
            return f"## Data refresh: nothing published\n\n{self.reason}"
        started = f"started: flow run {self.pipeline_run}" if self.pipeline_run else "not started"
        rows = [("corpus version", f"v{self.version}"),
                ("parent version", f"v{self.parent_version}" if self.parent_version else "none"),
                ("new inputs", f"{self.new_inputs:,}"), ("new clean documents", f"{self.new_docs:,}"),
                ("new clean tokens (est.)", f"{self.new_tokens:,}"), ("collect artifact", self.collect_dir),
                ("data gates", self.gates or "not checked"), ("pipeline", started)]
        table = "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])
        return f"## Data refresh: corpus v{self.version}\n\n{table}\n\n{self.reason}"


def current_inputs(collect: CollectConfig) -> dict[str, str]:
    """input -> version stamp, for every file the collect sources hold now. Demo sources are
    code, not files, and have nothing to refresh."""
    inputs: dict[str, str] = {}
    for text in collect.sources:
        kind = parse_source(text).kind
        if kind == "cc":
            urls = list_files(CommonCrawlSource.parse(text), collect.cc_base_url,
                              retries=collect.download_retries, timeout_s=collect.download_timeout_s)
            inputs.update({url: CC_STAMP for url in urls})
        elif kind == "files":
            for path in source_files(text, SUPPORTED_SUFFIXES):
                fs, inner = filesystem(str(path))
                # the store's own version key: cheap (no read), changes when the file does
                inputs[str(path)] = f"{fs.checksum(inner):x}"
    return inputs


def new_inputs(current: dict[str, str], versions: list[dict[str, Any]]) -> dict[str, str]:
    """The inputs of `current` that no published version holds with the same stamp."""
    seen = {(name, stamp) for v in versions for name, stamp in v["inputs"].items()}
    return {name: stamp for name, stamp in current.items() if (name, stamp) not in seen}


def corpus_sources(store: ArtifactStore, versions: list[dict[str, Any]]) -> list[str]:
    """The clean documents of every version: what the pipeline trains on after a refresh."""
    return [str(store.collect_dir(v) / "docs") for v in versions]


def _collect_config(config: PipelineConfig, sources: list[str],
                    dedup_index_from: str | None) -> PipelineConfig:
    """`config` whose collect reads `sources`. Per-source mix weights name the configured sources,
    which these are not, so mixing is left at its default (every document once)."""
    collect = config.section(COLLECT).model_dump(mode="json", exclude={"mix"})
    collect.update(sources=sources, dedup_index_from=dedup_index_from)
    return config.model_copy(update={COLLECT.name: CollectConfig.model_validate(collect)})


def _collect(config: PipelineConfig, store: ArtifactStore, version: int, parent: dict[str, Any] | None,
             new: dict[str, str], run_name: str) -> tuple[Manifest | None, Tracker, str]:
    """Run the collect stage on the new inputs, deduplicated against the parent version; returns
    (manifest, tracker, MLflow run id) or (None, ...) when no new document was kept."""
    index_from = str(store.collect_dir(parent)) if parent is not None and config.section(COLLECT).near_dedup else None
    refresh = _collect_config(config, sorted(new), index_from)
    [stage] = plan(refresh, store, until=COLLECT.name)
    tracker = Tracker(env.gristmill_home())
    run_id = start_parent_run(tracker, run_name, refresh, "refresh")
    meta = {"corpus_version": version, "parent_version": parent and parent["version"]}
    try:
        manifest = run_stage.with_options(task_run_name=f"{COLLECT.name} [refresh]")(
            stage, {}, Runtime(store, tracker, run_id, refresh), meta)
    except NothingSurvived:
        # the refresh did its job: the new files held nothing new (their collect task failed)
        tracker.set_tags(run_id, {"gristmill.refresh.published": "false"})
        tracker.end(run_id, ok=True)
        return None, tracker, run_id
    except BaseException:
        tracker.end(run_id, ok=False)
        raise
    return manifest, tracker, run_id


def _published(store: ArtifactStore, version: dict[str, Any] | None) -> tuple[int, Manifest] | None:
    """A published corpus version's number and collect manifest (None for no version)."""
    if version is None:
        return None
    manifest = store.load(COLLECT.name, version["collect_key"])
    if manifest is None:
        raise FileNotFoundError(f"corpus v{version['version']}: its collect artifact {version['collect_key']} "
                                "is not in the artifact store")
    return version["version"], manifest


def trigger(config: PipelineConfig, union: list[str], version: int,
            new_tokens: int) -> tuple[str | None, str]:
    """Start the pipeline deployment on the union corpus when the threshold is met: (flow run id
    or None, why)."""
    settings = config.refresh
    by_hand = f"gristmill run CONFIG '{COLLECT.name}.sources={json.dumps(union)}'"
    if new_tokens < settings.min_new_tokens:
        return None, (f"pipeline not started: ~{new_tokens:,} new clean tokens < refresh.min_new_tokens "
                      f"{settings.min_new_tokens:,}. To train on corpus v{version} anyway: {by_hand}")
    if not settings.trigger_pipeline:
        return None, f"pipeline not started: refresh.trigger_pipeline is false. To start it: {by_hand}"
    parameters = {"config": _collect_config(config, union, None).model_dump(mode="json")}
    try:
        # Called from synchronous code, so Prefect's async_dispatch returns the flow run itself.
        run = cast(FlowRun, run_deployment(settings.deployment, parameters=parameters, timeout=0,
                                           tags=["gristmill", f"corpus-v{version}"]))
    except ObjectNotFound:
        return None, (f"pipeline not started: no deployment {settings.deployment!r} on this Prefect server "
                      f"(serve it with `gristmill serve CONFIG`). To start it by hand: {by_hand}")
    return str(run.id), (f"pipeline started on corpus v1..v{version} ({len(union)} versions): "
                         f"deployment {settings.deployment!r}, flow run {run.id}; ~{new_tokens:,} new clean "
                         f"tokens >= refresh.min_new_tokens {settings.min_new_tokens:,}")


def refresh(config: PipelineConfig, store: ArtifactStore, approve_gates: bool = False) -> Outcome:
    """One refresh (under the corpus lock, so versions follow each other); see the module doc.
    GatesStopped or GatesRejected when the new version's data gates stop it (nothing published)."""
    logger = get_run_logger()
    versions = store.corpus_versions()
    latest = versions[-1] if versions else None
    parent_version = latest["version"] if latest else None
    current = current_inputs(config.section(COLLECT))
    new = new_inputs(current, versions)
    at = f"corpus v{parent_version}" if latest else "no corpus version yet"
    if not current:
        return Outcome(version=parent_version, new_inputs=0, published=False,
                       reason=f"{COLLECT.name}.sources name no files or Common Crawl paths: nothing to refresh "
                              "(a demo: source is generated by code)")
    if not new:
        return Outcome(version=parent_version, new_inputs=0, published=False, reason=(
            f"nothing new since {at}: all {len(current):,} input files of {COLLECT.name}.sources are in it"))
    version = (parent_version or 0) + 1
    logger.info("refresh: %d new input files since %s; collecting them as corpus v%d", len(new), at, version)
    manifest, tracker, run_id = _collect(config, store, version, latest, new,
                                         f"{config.name} refresh v{version}")
    if manifest is None:
        return Outcome(version=parent_version, new_inputs=len(new), published=False, reason=(
            f"the {len(new):,} new input files hold no document that passes the filters and is not "
            f"already in {at}; nothing published (they are read again by the next refresh)"))
    try:
        gates = enforce(manifest, config.section(COLLECT).gates, config.refresh.bytes_per_token, store, tracker,
                        run_id, approve_gates)
        stats = manifest.stats
        tokens = int(stats["bytes_out"] / config.refresh.bytes_per_token)
        store.add_corpus_version({
            "version": version, "parent_version": parent_version, "collect_key": manifest.key,
            "inputs": new, "docs": stats["docs_out"], "bytes": stats["bytes_out"], "est_tokens": tokens,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "prefect_flow_run_id": str(flow_run.id)})
        log_corpus_version(tracker, run_id, version, manifest, _published(store, latest))
        union = corpus_sources(store, store.corpus_versions())
        pipeline_run, reason = trigger(config, union, version, tokens)
        tracker.set_tags(run_id, {"gristmill.refresh.pipeline": pipeline_run or "not started"})
        tracker.log_text(run_id, reason, "refresh.md")
    except BaseException:
        tracker.end(run_id, ok=False)
        raise
    tracker.end(run_id, ok=True)
    return Outcome(version=version, new_inputs=len(new), published=True, parent_version=parent_version,
                   collect_dir=str(manifest.path), new_docs=stats["docs_out"], new_tokens=tokens,
                   pipeline_run=pipeline_run, reason=reason,
                   gates=gates.outcome + (f" by {gates.by}" if gates.by else ""))


@flow(name=DEPLOYMENT)
def data_refresh(config: PipelineConfig = PipelineConfig(), approve_gates: bool = False) -> dict[str, Any] | State:
    """Collect what is new in `config.collect.sources` into the next corpus version and start the
    pipeline on all versions when `config.refresh` says so; `approve_gates`: go on when a data gate
    trips, without asking (flows/gates.py)."""
    home = env.gristmill_home()
    store = home_store(home)
    try:
        with store.lock(CORPUS, "refresh"):
            outcome = refresh(config, store, approve_gates)
    except (GatesStopped, GatesRejected) as error:  # a decision, not a crash: no traceback
        return Failed(message=str(error), data=error)
    get_run_logger().info("data refresh: %s", outcome.reason if not outcome.published else
                          f"published corpus v{outcome.version}; {outcome.reason}")
    create_markdown_artifact(outcome.markdown(), key="data-refresh", description="What the refresh published")
    return asdict(outcome)
