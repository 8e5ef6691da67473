"""The stage table: every stage of the pipeline, in DAG order, each in one entry.

An entry holds the loader of the stage's code (a function that imports it and returns its `run`,
called only when the stage computes, so planning a run imports no torch; typed with
core.stage.StageRun, so the type checker holds `run` to the entry's config type), its config type
(the pipeline config gets one section per entry: flows/config.py),
its version and input fingerprint (both part of the artifact key), the upstream stages whose
manifests `run` receives as keyword arguments of the same names, the files every output of it
holds (its contract with the stages downstream: the store neither reuses nor passes `verify` an
output whose manifest lacks one), and how the flow runs it. Adding a stage is a package in `tasks/`
plus one entry here. Code outside a stage's own package names the stage through its entry here
(`EVALUATE.name`, `config.section(COLLECT)`), never by spelling it.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from gristmill.core.launch import LaunchConfig
from gristmill.core.sources import parse_source
from gristmill.core.stage import Manifest, StageConfig, StageRun
from gristmill.tasks.align import config as align
from gristmill.tasks.collect import config as collect
from gristmill.tasks.collect.read import demo_crawl
from gristmill.tasks.evaluate import config as evaluate
from gristmill.tasks.pretrain import config as pretrain
from gristmill.tasks.sft import config as sft
from gristmill.tasks.tokenize import config as tokenize

if TYPE_CHECKING:
    from gristmill.infra.tracking.runs import Tracker

C = TypeVar("C", bound=StageConfig)


class Publisher(Protocol):
    """Shows a stage's committed output in MLflow and Prefect (flows/reports.py), called as
    f(manifest, tracker, mlflow_run_id, owner) once the stage is done or reused; `owner`: the run
    is the one that holds the stage's outputs in MLflow (computed it, or back-fills them)."""

    def __call__(self, manifest: Manifest, tracker: Tracker, run_id: str, owner: bool, /) -> None: ...


def reads_no_external_data(config: StageConfig) -> None:
    """The fingerprint of a stage that reads nothing but its upstream artifacts."""


def no_sources(config: StageConfig) -> list[str]:
    """The data sources of a stage that names none in its config."""
    return []


def any_device(config: StageConfig) -> str:
    """The device of a stage whose config does not choose one: wherever it runs."""
    return "auto"


@dataclass(frozen=True, kw_only=True)
class StageSpec(Generic[C]):
    """One stage: `run(config, out_dir, *, engine, **upstream) -> StageResult`, returned by the
    loader `run`, taking a `config` instance and one keyword argument per name in `upstream`."""

    name: str  # its config section, artifact directory and MLflow run are named after it
    run: Callable[[], StageRun[C]]  # imports the stage's code and returns its `run`
    config: type[C]
    description: str  # of its config section
    version: int  # bump when outputs change for the same config
    fingerprint: Callable[[C], str | None] = reads_no_external_data  # digest of external data read
    upstream: tuple[str, ...] = ()
    # glob patterns (relative to the output folder) each of which some file of every output matches
    outputs: tuple[str, ...] = ()
    # a data-parallel stage: the Ray workers its config asks for (it gets a Ray engine); None: the
    # stage runs in-process
    ray_workers: Callable[[C], int] | None = None
    uses_gpu: bool = False  # computed under the `gpu` concurrency limit (flows/pipeline.py)
    # a training stage's `launch` section (core/launch.py) and the device its config asks for
    launch: Callable[[C], LaunchConfig] | None = None
    device: Callable[[C], str] = any_device
    # imports and returns what shows the stage in MLflow and Prefect once it is done or reused
    # (flows/reports.py); None: nothing
    publisher: Callable[[], Publisher] | None = None
    # the data sources its config names (core/sources.py) and the `demo:` names its code knows, so
    # that an unknown demo is found when the run is planned, not when the stage reads it
    sources: Callable[[C], list[str]] = no_sources
    demos: tuple[str, ...] = ()
    # its step metrics (core.stage.METRICS_FILE) whose columns contain one of these are drawn as
    # training curves on the report card (flows/report_card.py)
    curves: tuple[str, ...] = ()

    @property
    def uses_ray(self) -> bool:
        return self.ray_workers is not None

    def check_demos(self, config: C) -> None:
        """ValueError naming the first `demo:` source of `config` this stage does not know."""
        for text in self.sources(config):
            if (source := parse_source(text)).kind == "demo":
                source.demo(self.demos, f"{self.name} source")

    def load_run(self) -> StageRun[C]:
        """The stage's `run`, imported now; its upstream parameters must be this entry's."""
        run = self.run()
        if (taken := upstream_parameters(run)) != set(self.upstream):
            raise TypeError(f"stage {self.name!r}: {_qualified(run)} takes upstream {sorted(taken)}, "
                            f"the stage table gives it {sorted(self.upstream)}")
        return run

    def load_publisher(self) -> Publisher | None:
        return None if self.publisher is None else self.publisher()


def _qualified(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def upstream_parameters(run: Callable[..., Any]) -> set[str]:
    """The upstream stages a `run` takes: its keyword-only parameters besides `engine` and a training
    stage's `store_mapping` (core/stage.py)."""
    return {p.name for p in inspect.signature(run).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name not in ("engine", "store_mapping")}


# Each stage's code, imported when the stage computes (not when the table is read).
def _collect_run() -> StageRun[collect.Config]:
    from gristmill.tasks.collect.stage import run
    return run


def _tokenize_run() -> StageRun[tokenize.Config]:
    from gristmill.tasks.tokenize.stage import run
    return run


def _pretrain_run() -> StageRun[pretrain.Config]:
    from gristmill.tasks.pretrain.stage import run
    return run


def _sft_run() -> StageRun[sft.Config]:
    from gristmill.tasks.sft.stage import run
    return run


def _align_run() -> StageRun[align.Config]:
    from gristmill.tasks.align.stage import run
    return run


def _evaluate_run() -> StageRun[evaluate.Config]:
    from gristmill.tasks.evaluate.stage import run
    return run


# What each stage shows in MLflow and Prefect (flows/reports.py imports MLflow and Prefect).
def _publish_collect() -> Publisher:
    from gristmill.flows.reports import publish_collect
    return publish_collect


def _publish_model() -> Publisher:
    from gristmill.flows.reports import publish_model
    return publish_model


def _publish_evaluate() -> Publisher:
    from gristmill.flows.reports import publish_evaluate
    return publish_evaluate


# The generated arithmetic tasks (core/arithmetic.py) SFT's and align's readers know as `demo:arithmetic`.
ARITHMETIC_DEMOS = ("arithmetic",)
# A training stage's export (model/export.py): the HF model folder the next stage and evaluate load.
MODEL_OUTPUTS = ("model/config.json", "model/*.safetensors", "model/tokenizer_config.json")

COLLECT = StageSpec(
    name="collect", run=_collect_run, config=collect.Config, description="Collect and clean raw documents.",
    version=collect.VERSION, fingerprint=collect.fingerprint,
    outputs=("docs/*.jsonl.gz", "funnel.json"), ray_workers=lambda config: config.num_workers,
    publisher=_publish_collect, sources=lambda config: config.sources, demos=(demo_crawl.DEMO_NAME,))
TOKENIZE = StageSpec(
    name="tokenize", run=_tokenize_run, config=tokenize.Config,
    description="Train the tokenizer, write token shards.",
    version=tokenize.VERSION, fingerprint=tokenize.fingerprint, upstream=(COLLECT.name,),
    ray_workers=lambda config: config.num_workers,
    outputs=("tokenizer/tokenizer.json", "tokens/train.bin", "tokens/val.bin", "tokens/meta.json",
             "tokens/index.json"))
PRETRAIN = StageSpec(
    name="pretrain", run=_pretrain_run, config=pretrain.Config, description="Next-token pretraining.",
    version=pretrain.VERSION, fingerprint=pretrain.fingerprint,
    upstream=(TOKENIZE.name,), outputs=MODEL_OUTPUTS, uses_gpu=True,
    launch=lambda config: config.launch, device=lambda config: config.device, curves=("loss", "val_loss"))
# tokenize: the pretraining text SFT mixes in (sft.pretrain_mix)
SFT = StageSpec(
    name="sft", run=_sft_run, config=sft.Config, description="Supervised fine-tuning on conversations.",
    version=sft.VERSION, fingerprint=sft.fingerprint,
    upstream=(TOKENIZE.name, PRETRAIN.name), outputs=MODEL_OUTPUTS, uses_gpu=True,
    launch=lambda config: config.launch, device=lambda config: config.device, curves=("loss", "heldout_loss"),
    publisher=_publish_model, sources=lambda config: config.data, demos=ARITHMETIC_DEMOS)
ALIGN = StageSpec(
    name="align", run=_align_run, config=align.Config, description="Preference alignment.",
    version=align.VERSION, fingerprint=align.fingerprint,
    upstream=(SFT.name,), outputs=MODEL_OUTPUTS, uses_gpu=True,
    launch=lambda config: config.launch, device=lambda config: config.train_device(),
    curves=("reward", "kl", "margin", "loss"), publisher=_publish_model,
    sources=lambda config: config.method_config().sources(), demos=ARITHMETIC_DEMOS)
# collect: the training text benchmark items are checked against (contamination)
EVALUATE = StageSpec(
    name="evaluate", run=_evaluate_run, config=evaluate.Config, description="Evaluation and report.",
    version=evaluate.VERSION, fingerprint=evaluate.fingerprint,
    upstream=(COLLECT.name, TOKENIZE.name, PRETRAIN.name, SFT.name, ALIGN.name), outputs=("results.json",),
    uses_gpu=True, publisher=_publish_evaluate)

STAGES: tuple[StageSpec[Any], ...] = (COLLECT, TOKENIZE, PRETRAIN, SFT, ALIGN, EVALUATE)
STAGE_NAMES = tuple(spec.name for spec in STAGES)


def contracts(stages: Sequence[StageSpec[Any]] = STAGES) -> dict[str, tuple[str, ...]]:
    """stage -> the files every output of it holds: the artifact store's `contracts`."""
    return {spec.name: spec.outputs for spec in stages}


def checked(stages: Sequence[StageSpec[Any]]) -> tuple[StageSpec[Any], ...]:
    """`stages` as a table, once each name is unique and every upstream comes before its stage."""
    seen: set[str] = set()
    for spec in stages:
        if spec.name in seen:
            raise ValueError(f"stage {spec.name!r} is in the table twice")
        if missing := [name for name in spec.upstream if name not in seen]:
            raise ValueError(f"stage {spec.name!r}: upstream {missing} must come before it in the table")
        seen.add(spec.name)
    return tuple(stages)


def stages_until(until: str | None, stages: Sequence[StageSpec[Any]] = STAGES) -> tuple[StageSpec[Any], ...]:
    """The stages up to and including `until` (all of them when None); tables are in DAG order."""
    names = [spec.name for spec in stages]
    if until is None:
        return tuple(stages)
    if until not in names:
        raise ValueError(f"--until {until!r} is not a stage; choose one of {', '.join(names)}")
    return tuple(stages[: names.index(until) + 1])
