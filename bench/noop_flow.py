"""A flow of no-op stages, to measure what the Prefect task, MLflow child run and artifact store
add to each stage (imported only in a configured process: flows/entry.py)."""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from prefect import flow

from gristmill.core.stage import StageConfig, StageResult
from gristmill.flows.config import PipelineConfig
from gristmill.flows.dag import PlannedStage
from gristmill.flows.pipeline import Runtime, run_stage
from gristmill.flows.stages import StageSpec
from gristmill.infra import env
from gristmill.infra.artifacts import home_store
from gristmill.infra.tracking.runs import Tracker

VERSION = 1
_SALT = uuid.uuid4().hex  # fresh keys per benchmark process, identical within it (so reuse hits)


class Config(StageConfig):
    index: int = 0


def run(config: Config, out_dir: Path, *, engine: Any) -> StageResult:
    return StageResult(stats={})


_SPEC = StageSpec(name="noop", run=lambda: run, config=Config, description="Does nothing.",
                  version=VERSION)


def direct_seconds(n: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        run(Config(index=i), Path("."), engine=None)
    return time.perf_counter() - started


@flow(name="noop-stages")
def noop_flow(n: int) -> float:
    """Runs n no-op stages (computed the first time, reused after); returns their wall seconds."""
    home = env.gristmill_home()
    tracker = Tracker(home)
    runtime = Runtime(home_store(home), tracker,
                      tracker.start_pipeline("noop-bench", {}, {}), PipelineConfig())
    started = time.perf_counter()
    for i in range(n):
        stage = PlannedStage(spec=_SPEC, config=Config(index=i), key=f"{_SALT[:8]}{i:04d}", complete=False)
        run_stage(stage, {}, runtime)
    return time.perf_counter() - started
