"""The plan: every stage's artifact key, known before anything runs; and a planned stage's run.

Keys depend only on configs, stage versions, upstream keys and input fingerprints, so the whole
plan (including which stages will be reused) is computed up front; `--dry-run` prints it. The
stages and their order are the config's stage table (flows/stages.py).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gristmill.core.launch import LaunchConfig, launch_problems, sharding_problems
from gristmill.core.stage import Engine, Manifest, StageConfig, StageResult
from gristmill.flows.config import PipelineConfigBase
from gristmill.flows.stages import COLLECT, StageSpec, contracts, stages_until
from gristmill.infra import env
from gristmill.infra.artifacts import ArtifactStore, home_store, stage_key
from gristmill.model.checkpoint import StoreMapping
from gristmill.model.config import LoopConfig
from gristmill.tasks.collect.read import demo_crawl


@dataclass(frozen=True, kw_only=True)
class PlannedStage:
    """A stage of this run: its table entry, its section of the config and its artifact key."""

    spec: StageSpec[Any]
    config: StageConfig
    key: str
    complete: bool  # a committed artifact with this key exists, so the stage will be reused
    inputs_fingerprint: str | None = None  # digest of the external inputs it reads (part of the key)

    @property
    def ray_workers(self) -> int:
        """The Ray workers its config asks for (a data-parallel stage; core/stage.Engine); 1 for the others."""
        return 1 if self.spec.ray_workers is None else self.spec.ray_workers(self.config)

    @property
    def launch(self) -> LaunchConfig | None:
        """Its config's `launch` section (a training stage: core/launch.py); None for the others."""
        return None if self.spec.launch is None else self.spec.launch(self.config)


def plan(config: PipelineConfigBase, store: ArtifactStore, until: str | None = None) -> list[PlannedStage]:
    """The stages of `config`'s table up to `until` (all when None), in DAG order, with their keys."""
    keys: dict[str, str] = {}
    planned = []
    for spec in stages_until(until, config.stages):
        stage_config = config.section(spec)
        spec.check_demos(stage_config)
        inputs = spec.fingerprint(stage_config)
        key = stage_key(spec.name, spec.version, stage_config.hashed_dict(),
                        {name: keys[name] for name in spec.upstream}, inputs)
        keys[spec.name] = key
        planned.append(PlannedStage(spec=spec, config=stage_config, key=key, inputs_fingerprint=inputs,
                                    complete=store.has(spec.name, key)))
    return planned


def stage_device(stage: PlannedStage) -> str:
    """The device a training stage's config asks for ("auto", "cpu", "cuda"), as its table entry
    reads it."""
    return stage.spec.device(stage.config)


def open_store(config: PipelineConfigBase, home: Path) -> ArtifactStore:
    """The artifact store under `home`, checking reused outputs as `config.store` says and against
    the contracts of `config`'s stages."""
    return home_store(home, config.store.verify_on_reuse, contracts(config.stages))


def plan_problem(planned: list[PlannedStage], store: ArtifactStore, home: Path) -> str | None:
    """The one line saying why the planned run cannot start, or None: all a run checks before
    it starts anything, and a dry run before it prints anything."""
    if problem := writing_problem(store, home):  # a read-only store: not at the first commit
        return problem
    if problems := env.requirement_problems():  # an older torch, a dependency removed since the install
        return "; ".join(problems)
    if problems := launch_problems_of(planned):  # a stage's processes cannot start as asked
        return "; ".join(problems)
    return None


def writing_problem(store: ArtifactStore, home: Path) -> str | None:
    """Why a run could not write its state or outputs: GRISTMILL_HOME or the store's folder is
    not a folder it can write in (a file in its place, a read-only mount). Checked when the run
    is planned, without creating either, instead of failing at the first stage's commit."""
    if problem := env.unwritable(home):
        return f"GRISTMILL_HOME={home}: {problem}"
    if problem := env.unwritable(store.root):
        return f"artifact store {store.root}: {problem}"
    return None


def demo_corpus(planned: list[PlannedStage]) -> tuple[demo_crawl.CorpusDigest, str | None] | None:
    """What the collect stage's demo source reads, as its key digests it, and the line saying how
    that differs from the reference corpus (None when it is the reference); None when the plan
    reads no demo source (tasks/collect/read/demo_crawl.py)."""
    collect = next((stage.config for stage in planned if stage.spec.name == COLLECT.name), None)
    if not isinstance(collect, COLLECT.config) or demo_crawl.DEMO_SOURCE not in collect.sources:
        return None
    packages = demo_crawl.list_packages()
    digest = demo_crawl.corpus_digest(packages)
    return digest, demo_crawl.reference_difference(packages, digest)


def launch_problems_of(planned: list[PlannedStage]) -> list[str]:
    """What is wrong with the `launch` sections of the stages that will compute (core/launch.py),
    one line each; checked before any service starts."""
    problems = []
    for stage in planned:
        if stage.complete or (launch := stage.launch) is None:
            continue
        section, device = f"{stage.spec.name}.launch", stage_device(stage)
        problems += launch_problems(section, launch, device)
        if isinstance(stage.config, LoopConfig):  # trained by model/loop.py, which shards by itself
            problems += sharding_problems(section, launch, device, stage.config.fsdp)
    return problems


def run_planned(stage: PlannedStage, upstream: Mapping[str, Manifest], out_dir: Path, *,
                engine: Engine, store_mapping: StoreMapping | None) -> StageResult:
    """Run the stage's code into `out_dir`, each upstream manifest passed as the keyword argument
    named after its stage, once each is checked to be the manifest of the stage it is given as;
    a training stage gets `store_mapping` (its store's `store_mapping`: where its checkpoints live)."""
    spec = stage.spec
    if set(upstream) != set(spec.upstream):
        raise ValueError(f"stage {spec.name!r} takes upstream {sorted(spec.upstream)}, "
                         f"given {sorted(upstream)}")
    if wrong := {name: m.stage for name, m in upstream.items() if m.stage != name}:
        raise ValueError(f"stage {spec.name!r}: upstream given a manifest of another stage ({wrong})")
    training = {"store_mapping": store_mapping} if spec.launch is not None else {}
    return spec.load_run()(stage.config, out_dir, engine=engine, **training, **upstream)


def manifest_fields(stage: PlannedStage, upstream: Mapping[str, Manifest], result: StageResult,
                    meta: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of the manifest a computed stage commits (the store adds key, files, seconds);
    `meta` adds to its meta (the MLflow and Prefect runs, the launch, a corpus version)."""
    return {
        "config": stage.config.model_dump(mode="json"),
        "upstream": {name: m.key for name, m in upstream.items()},
        "stats": {**result.stats, **result.measured},
        "meta": {"stage_version": stage.spec.version, "code_version": env.code_version(),
                 **({"inputs_fingerprint": stage.inputs_fingerprint} if stage.inputs_fingerprint else {}),
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **meta},
    }
