"""The six stages as a DAG, and the plan: every stage's artifact key, known before anything runs.

Keys depend only on configs, stage versions, upstream keys and input fingerprints, so the whole
plan (including which stages will be reused) is computed up front; `--dry-run` prints it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from core.stage import StageConfig
from flows.config import PipelineConfig
from infra.artifacts import ArtifactStore, stage_key
from tasks import align, collect, evaluate, pretrain, sft, tokenize


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: ModuleType  # a tasks/ package exposing the contract of core/stage.py
    deps: tuple[str, ...]
    uses_ray: bool = False  # data-parallel stages get a Ray engine; the rest run in-process
    uses_gpu: bool = False  # computed under the `gpu` concurrency limit (flows/pipeline.py)


STAGES: tuple[StageSpec, ...] = (
    StageSpec("collect", collect, (), uses_ray=True),
    StageSpec("tokenize", tokenize, ("collect",), uses_ray=True),
    StageSpec("pretrain", pretrain, ("tokenize",), uses_gpu=True),
    # tokenize: the pretraining text SFT mixes in (sft.pretrain_mix)
    StageSpec("sft", sft, ("tokenize", "pretrain"), uses_gpu=True),
    StageSpec("align", align, ("sft",), uses_gpu=True),
    # collect: the training text benchmark items are checked against (contamination)
    StageSpec("evaluate", evaluate, ("collect", "tokenize", "pretrain", "sft", "align"), uses_gpu=True),
)
STAGE_NAMES = tuple(spec.name for spec in STAGES)


@dataclass(frozen=True)
class PlannedStage:
    spec: StageSpec
    config: StageConfig
    key: str
    complete: bool  # a committed artifact with this key exists, so the stage will be reused


def stages_until(until: str | None) -> tuple[StageSpec, ...]:
    """The stages up to and including `until` (all of them when None); STAGES is in DAG order."""
    if until is None:
        return STAGES
    if until not in STAGE_NAMES:
        raise ValueError(f"--until {until!r} is not a stage; choose one of {', '.join(STAGE_NAMES)}")
    return STAGES[: STAGE_NAMES.index(until) + 1]


def plan(config: PipelineConfig, store: ArtifactStore, until: str | None = None) -> list[PlannedStage]:
    keys: dict[str, str] = {}
    planned = []
    for spec in stages_until(until):
        stage_config = getattr(config, spec.name)
        key = stage_key(spec.name, spec.module.VERSION, stage_config.hashed_dict(),
                        {dep: keys[dep] for dep in spec.deps}, spec.module.fingerprint(stage_config))
        keys[spec.name] = key
        planned.append(PlannedStage(spec, stage_config, key, store.load(spec.name, key) is not None))
    return planned
