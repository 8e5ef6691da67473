"""The contract every pipeline stage follows.

A stage is a package in `tasks/` with

    config.py  VERSION: int                      # bump when outputs change for the same config
               class Config(StageConfig)         # its own typed config, strict about unknown keys
               def fingerprint(config) -> str | None  # digest of external data it reads (core.sources)
    stage.py   def run(config, out_dir, *, engine, <upstream>: Manifest, ...) -> StageResult

and one entry in the stage table (flows/stages.py) naming them and its upstream stages. Planning a
run needs only config.py, so it imports none of the stage's heavy dependencies (torch, TRL,
datatrove...); stage.py is imported when the stage computes.

`run` receives each upstream stage's committed `Manifest` as the keyword argument named after that
stage (`def run(config, out_dir, *, engine, tokenize: Manifest)`); its keyword parameters besides
`engine` are its upstream stages, and the table's entry must name the same ones. A training stage
(one with a `launch` section) also takes `store_mapping`: the artifact store's local root and its
bucket, or None, from which it builds the place of its checkpoints (model/checkpoint.py).
`StageRun` is this contract as a type: the table's entries are typed with it, so the type checker
holds every `run` to its entry's config type (flows/stages.py). `out_dir` is the only place the
stage may write (it is a `.partial` directory that survives a crash, so a long stage can keep
checkpoints there and resume). Stages import neither Prefect nor MLflow: the flow layer wraps them
with the artifact store and tracking.
"""
from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from gristmill.core.progress import Reporter

# Step-wise metrics a stage appends as JSON lines ({"step": int, "<name>": float, ...}); the
# tracking layer replays them into the stage's MLflow run.
METRICS_FILE = "metrics.jsonl"

T = TypeVar("T")
R = TypeVar("R")
# The config type of a stage's `run`: it takes that type (and no other stage's), hence contravariant.
ConfigT = TypeVar("ConfigT", bound="StageConfig", contravariant=True)
_map_log = logging.getLogger("gristmill.map")


class InputError(ValueError):
    """A stage's inputs cannot give its output, found only when they are read (no source yielded a
    document, a crawl the server does not know): the user's to fix, not a crash, so a run reports
    it in one line (exit 2) without a traceback. Mistakes found without reading the data are the
    plan's to report (core/sources.py, the configs' validation)."""


class StageConfig(BaseModel):
    """Base of every stage config: frozen, unknown keys are errors that name the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Operational knobs that do not change outputs (worker counts, log intervals) are listed here
    # by subclasses and left out of the artifact hash. Everything else is hashed.
    unhashed_fields: ClassVar[frozenset[str]] = frozenset()

    def hashed_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude=set(self.unhashed_fields))


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The committed record of one stage output; `path` is the artifact directory."""

    stage: str
    key: str
    path: Path
    config: dict[str, Any]
    upstream: dict[str, str]
    files: dict[str, dict[str, Any]]
    stats: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "key": self.key, "config": self.config,
            "upstream": self.upstream, "files": self.files, "stats": self.stats, "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], path: Path) -> Manifest:
        return cls(path=path, **data)

    @classmethod
    def of_directory(cls, stage: str, path: Path) -> Manifest:
        """A stand-in for a stage output found outside the artifact store (a directory given on a
        command line): stages read only `path` from their inputs' manifests."""
        return cls(stage=stage, key="external", path=Path(path), config={}, upstream={}, files={}, stats={})


@dataclass
class StageResult:
    """What a stage returns: summary stats (numbers become MLflow metrics, the rest params/tags)
    and the small files (relative to out_dir) worth attaching to the MLflow run."""

    stats: dict[str, Any]
    artifacts: list[str] = field(default_factory=list)
    # What differs from run to run of the same inputs (seconds): joins `stats` in the manifest and
    # in MLflow, kept apart here so that `stats` stay a function of the inputs.
    measured: dict[str, float] = field(default_factory=dict)


class Engine(Protocol):
    """Runs a picklable function over items, in parallel where it can, results in input order."""

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]: ...


class StageRun(Protocol[ConfigT]):
    """A stage's `run`: `run(config, out_dir, *, engine, **upstream) -> StageResult`.

    The config type, `out_dir`, the `engine` keyword and the result are checked statically. The
    upstream keywords are named by the stage table's entry, which is data: the checker takes them
    as given (`*_: Any, **upstream: Any`), and the table checks their names when it loads `run`."""

    def __call__(self, config: ConfigT, out_dir: Path, /, *_: Any, engine: Engine,
                 **upstream: Any) -> StageResult: ...


def worker_dir(engine: Engine, local: Path) -> str:
    """Where `engine`'s workers write what belongs in the stage folder `local`: `local` itself when
    they share this machine's disk, else the URL its `worker_dirs` maps it to (the partial folder's
    place on the artifact store's bucket)."""
    mapping = getattr(engine, "worker_dirs", None)
    return mapping(Path(local)) if mapping is not None else str(local)


class SerialEngine:
    """In-process engine for tests and for stages too small to be worth a cluster."""

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        results = []
        with map_progress(fn, len(items)) as progress:
            for item in items:
                results.append(fn(item))
                progress.advance(1)
        return results


def load(dotted: str) -> Any:
    """The object at "module.name", importing the module (the stage table names code this way, so
    that reading the table imports no stage's dependencies)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def map_name(fn: Callable) -> str:
    """What an engine's map of `fn` is called in progress and logs: the function's name."""
    return getattr(fn, "__name__", "map").strip("_") or "map"


def map_progress(fn: Callable, units: int) -> Reporter:
    """The progress of an engine's map of `fn` over `units` work units (core/progress.py), started."""
    return Reporter(map_name(fn), unit="unit", log=_map_log).start(units)


class MetricsLog:
    """Appends step-wise metrics to `out_dir/metrics.jsonl`; safe to reopen after a resume."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / METRICS_FILE

    def log(self, step: int, **values: float | str) -> None:
        """Numbers become the stage's MLflow metrics; a string (a rollback's reason) stays in the file."""
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop entries logged after `step` (they belong to work a resume will redo)."""
        kept = [r for r in read_metrics(self.path) if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
