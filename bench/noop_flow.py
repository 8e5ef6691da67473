"""A flow of no-op stages, to measure what the Prefect task, MLflow child run and artifact store
add to each stage (imported only after `infra.env.configure`)."""
from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from prefect import flow

from core.stage import Manifest, StageConfig, StageResult
from flows.dag import PlannedStage, StageSpec
from flows.pipeline import Runtime, run_stage
from infra import env
from infra.artifacts import ArtifactStore
from infra.tracking import Tracker

VERSION = 1
_SALT = uuid.uuid4().hex  # fresh keys per benchmark process, identical within it (so reuse hits)


class Config(StageConfig):
    index: int = 0


def run(config: Config, inputs: Mapping[str, Manifest], out_dir: Path, *, engine: Any) -> StageResult:
    return StageResult(stats={})


_SPEC = StageSpec("noop", sys.modules[__name__], ())


def direct_seconds(n: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        run(Config(index=i), {}, Path("."), engine=None)
    return time.perf_counter() - started


@flow(name="noop-stages")
def noop_flow(n: int) -> float:
    """Runs n no-op stages (computed the first time, reused after); returns their wall seconds."""
    home = env.configure()
    tracker = Tracker(home)
    runtime = Runtime(ArtifactStore(env.artifacts_root(home)), tracker,
                      tracker.start_pipeline("noop-bench", {}, {}))
    started = time.perf_counter()
    for i in range(n):
        stage = PlannedStage(_SPEC, Config(index=i), f"{_SALT[:8]}{i:04d}", False)
        run_stage(stage, {}, runtime)
    return time.perf_counter() - started
