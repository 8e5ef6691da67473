"""Running the real `gristmill` CLI against a home of its own, and reading what a run committed:
shared by the benchmarks that run the pipeline (`bench chaos`, `bench store-fuzz`, `bench scale`)
and the end-to-end tests."""
from __future__ import annotations

import json
import os
from pathlib import Path

from gristmill.flows.stages import STAGE_NAMES

REPO = Path(__file__).resolve().parents[2]
# The real data benchmarks and tests read (SOURCES.md there says where each file comes from).
SHARED_DATA = Path(os.environ.get("GRISTMILL_SHARED_DATA", REPO.parent / "shared" / "data"))
STAGES = list(STAGE_NAMES)
# The tiny preset, shortened so a training stage takes seconds, not minutes.
SHORT = ["pretrain.max_steps=60", "sft.max_steps=30", "align.grpo.max_steps=10",
         "evaluate.arith_problems=20", "evaluate.max_eval_tokens=8192"]
TIMED_FILES = {"metrics.jsonl"}  # step metrics carry tokens/s: the one output that differs by run
SERVICE_VARS = ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS", "PREFECT_HOME")


def cpu_description() -> dict[str, str | int]:
    """The CPU figures were measured on: its model name, the widest vector instructions torch's
    CPU kernels use on it (`torch.backends.cpu.get_cpu_capability()`: AVX2, AVX512, ...) and the
    cores this process may use."""
    import torch

    models = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
              if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return {"model": models[0] if models else "unknown", "capability": torch.backends.cpu.get_cpu_capability(),
            "cores": len(os.sched_getaffinity(0))}


def cli_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment pointed at `home`, with no external service configured but
    those `extra` names."""
    env = {**os.environ, "GRISTMILL_HOME": str(home)}
    for var in SERVICE_VARS:
        env.pop(var, None)
    return {**env, **(extra or {})}


def committed_dir(home: Path, stage: str) -> Path:
    """The committed output of `stage` in `home` (StopIteration when there is none)."""
    return next((home / "artifacts" / stage).glob("*/manifest.json")).parent


def committed_files(home: Path, stage: str) -> dict[str, str]:
    """relative path -> sha256 of the committed output of `stage` in `home`, but the files that
    record timings."""
    return manifest_files(committed_dir(home, stage))


def manifest_files(artifact: Path) -> dict[str, str]:
    """relative path -> sha256 of the committed `artifact` directory (from its manifest), but the
    files that record timings."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    return {rel: info["sha256"] for rel, info in manifest["files"].items()
            if Path(rel).name not in TIMED_FILES}
