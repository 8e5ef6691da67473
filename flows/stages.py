"""The stage table: every stage of the pipeline, in DAG order, each in one entry.

An entry names the stage's code (`run`, imported only when the stage computes, so planning a run
imports no torch), its config type (the pipeline config gets one section per entry: flows/config.py),
its version and input fingerprint (both part of the artifact key), the upstream stages whose
manifests `run` receives as keyword arguments of the same names, the files every output of it
holds (its contract with the stages downstream: the store neither reuses nor passes `verify` an
output whose manifest lacks one), and how the flow runs it. Adding a stage is a package in `tasks/`
plus one entry here.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.sources import parse_source
from core.stage import StageConfig, StageResult, load
from tasks.align import config as align
from tasks.collect import config as collect
from tasks.collect import demo_crawl
from tasks.evaluate import config as evaluate
from tasks.pretrain import config as pretrain
from tasks.sft import config as sft
from tasks.tokenize import config as tokenize


def reads_no_external_data(config: StageConfig) -> None:
    """The fingerprint of a stage that reads nothing but its upstream artifacts."""


def no_sources(config: StageConfig) -> list[str]:
    """The data sources of a stage that names none in its config."""
    return []


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One stage: `run(config, out_dir, *, engine, **upstream) -> StageResult` at the dotted name
    `run`, taking a `config` instance and one keyword argument per name in `upstream`."""

    name: str  # its config section, artifact directory and MLflow run are named after it
    run: str  # "module.function" of the stage's code
    config: type[StageConfig]
    description: str  # of its config section
    version: int  # bump when outputs change for the same config
    fingerprint: Callable[[Any], str | None] = reads_no_external_data  # digest of external data read
    upstream: tuple[str, ...] = ()
    # glob patterns (relative to the output folder) each of which some file of every output matches
    outputs: tuple[str, ...] = ()
    uses_ray: bool = False  # data-parallel stages get a Ray engine; the rest run in-process
    # "module.function" each Ray worker started ahead of the stage calls first (what its units
    # all load: imports, models), so that cost overlaps the run's own start (infra/ray_start.py)
    warm_worker: str | None = None
    uses_gpu: bool = False  # computed under the `gpu` concurrency limit (flows/pipeline.py)
    # "module.function" called as f(manifest, tracker, mlflow_run_id, owner) once the stage is
    # done or reused, to show it in MLflow and Prefect (flows/reports.py); `owner`: the run is the
    # one that holds the stage's outputs in MLflow (computed it, or back-fills them); None: nothing
    publisher: str | None = None
    # the data sources its config names (core/sources.py) and the `demo:` names its code knows, so
    # that an unknown demo is found when the run is planned, not when the stage reads it
    sources: Callable[[Any], list[str]] = no_sources
    demos: tuple[str, ...] = ()

    def check_demos(self, config: StageConfig) -> None:
        """ValueError naming the first `demo:` source of `config` this stage does not know."""
        for text in self.sources(config):
            if (source := parse_source(text)).kind == "demo":
                source.demo(self.demos, f"{self.name} source")

    def load_run(self) -> Callable[..., StageResult]:
        """The stage's `run`, imported now; its upstream parameters must be this entry's."""
        run = load(self.run)
        if (taken := upstream_parameters(run)) != set(self.upstream):
            raise TypeError(f"stage {self.name!r}: {self.run} takes upstream {sorted(taken)}, "
                            f"the stage table gives it {sorted(self.upstream)}")
        return run

    def load_publisher(self) -> Callable[..., None] | None:
        return None if self.publisher is None else load(self.publisher)


def upstream_parameters(run: Callable[..., Any]) -> set[str]:
    """The upstream stages a `run` takes: its keyword-only parameters besides `engine`."""
    return {p.name for p in inspect.signature(run).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name != "engine"}


# The generated arithmetic tasks (core/arithmetic.py) SFT's and align's readers know as `demo:arithmetic`.
ARITHMETIC_DEMOS = ("arithmetic",)
# A training stage's export (model/export.py): the HF model folder the next stage and evaluate load.
MODEL_OUTPUTS = ("model/config.json", "model/*.safetensors", "model/tokenizer_config.json")

STAGES: tuple[StageSpec, ...] = (
    StageSpec(name="collect", run="tasks.collect.stage.run", config=collect.Config,
              description="Collect and clean raw documents.",
              version=collect.VERSION, fingerprint=collect.fingerprint,
              outputs=("docs/*.jsonl.gz", "funnel.json"), uses_ray=True, warm_worker="tasks.collect.stage.warm_worker",
              publisher="flows.reports.publish_collect",
              sources=lambda config: config.sources, demos=(demo_crawl.DEMO_NAME,)),
    StageSpec(name="tokenize", run="tasks.tokenize.stage.run", config=tokenize.Config,
              description="Train the tokenizer, write token shards.",
              version=tokenize.VERSION, fingerprint=tokenize.fingerprint,
              upstream=("collect",), uses_ray=True,
              outputs=("tokenizer/tokenizer.json", "tokens/train.bin", "tokens/val.bin", "tokens/meta.json",
                       "tokens/index.json")),
    StageSpec(name="pretrain", run="tasks.pretrain.stage.run", config=pretrain.Config,
              description="Next-token pretraining.",
              version=pretrain.VERSION, fingerprint=pretrain.fingerprint,
              upstream=("tokenize",), outputs=MODEL_OUTPUTS, uses_gpu=True),
    # tokenize: the pretraining text SFT mixes in (sft.pretrain_mix)
    StageSpec(name="sft", run="tasks.sft.stage.run", config=sft.Config,
              description="Supervised fine-tuning on conversations.",
              version=sft.VERSION, fingerprint=sft.fingerprint,
              upstream=("tokenize", "pretrain"), outputs=MODEL_OUTPUTS, uses_gpu=True,
              publisher="flows.reports.publish_model", sources=lambda config: config.data, demos=ARITHMETIC_DEMOS),
    StageSpec(name="align", run="tasks.align.stage.run", config=align.Config,
              description="Preference alignment.",
              version=align.VERSION, fingerprint=align.fingerprint,
              upstream=("sft",), outputs=MODEL_OUTPUTS, uses_gpu=True, publisher="flows.reports.publish_model",
              sources=lambda config: config.method_config().sources(), demos=ARITHMETIC_DEMOS),
    # collect: the training text benchmark items are checked against (contamination)
    StageSpec(name="evaluate", run="tasks.evaluate.stage.run", config=evaluate.Config,
              description="Evaluation and report.",
              version=evaluate.VERSION, fingerprint=evaluate.fingerprint,
              upstream=("collect", "tokenize", "pretrain", "sft", "align"), outputs=("results.json",), uses_gpu=True,
              publisher="flows.reports.publish_evaluate"),
)
STAGE_NAMES = tuple(spec.name for spec in STAGES)


def contracts(stages: Sequence[StageSpec] = STAGES) -> dict[str, tuple[str, ...]]:
    """stage -> the files every output of it holds: the artifact store's `contracts`."""
    return {spec.name: spec.outputs for spec in stages}


def checked(stages: Sequence[StageSpec]) -> tuple[StageSpec, ...]:
    """`stages` as a table, once each name is unique and every upstream comes before its stage."""
    seen: set[str] = set()
    for spec in stages:
        if spec.name in seen:
            raise ValueError(f"stage {spec.name!r} is in the table twice")
        if missing := [name for name in spec.upstream if name not in seen]:
            raise ValueError(f"stage {spec.name!r}: upstream {missing} must come before it in the table")
        seen.add(spec.name)
    return tuple(stages)


def stages_until(until: str | None, stages: Sequence[StageSpec] = STAGES) -> tuple[StageSpec, ...]:
    """The stages up to and including `until` (all of them when None); tables are in DAG order."""
    names = [spec.name for spec in stages]
    if until is None:
        return tuple(stages)
    if until not in names:
        raise ValueError(f"--until {until!r} is not a stage; choose one of {', '.join(names)}")
    return tuple(stages[: names.index(until) + 1])
