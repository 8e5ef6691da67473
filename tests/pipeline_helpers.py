"""Running the real `gristmill` CLI from tests: one tiny-pipeline configuration for every
end-to-end test, so they share one run (the `tiny_run` fixture in conftest.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
STAGES = ["collect", "tokenize", "pretrain", "sft", "align", "evaluate"]
# The tiny preset, shortened so CI spends seconds, not minutes, per training stage.
FAST = ["pretrain.max_steps=60", "sft.max_steps=30", "align.grpo.max_steps=10",
        "evaluate.arith_problems=20", "evaluate.max_eval_tokens=8192"]


def cli_env(home: Path) -> dict[str, str]:
    """This process's environment pointed at `home`, with no external service configured."""
    env = {**os.environ, "GRISTMILL_HOME": str(home)}
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS", "PREFECT_HOME"):
        env.pop(var, None)
    return env


def gristmill(home: Path, *args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=cli_env(home),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"gristmill {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def committed_dir(home: Path, stage: str) -> Path:
    return next((home / "artifacts" / stage).glob("*/manifest.json")).parent


TIMED_FILES = {"metrics.jsonl"}  # step metrics carry tokens/s: the one output that differs by run


def committed_files(home: Path, stage: str) -> dict[str, str]:
    """relative path -> sha256 of the committed output of `stage` (from its manifest), but the
    files that record timings."""
    manifest = json.loads((committed_dir(home, stage) / "manifest.json").read_text())
    return {rel: info["sha256"] for rel, info in manifest["files"].items()
            if Path(rel).name not in TIMED_FILES}


def plan_of(home: Path, overrides: list[str], *more: str) -> dict[str, str]:
    """stage -> 'reuse' | 'run', as printed by --dry-run."""
    out = gristmill(home, "run", "configs/tiny.yaml", *overrides, *more, "--dry-run").stdout
    rows = [line.split() for line in out.split("# plan", 1)[1].splitlines()[1:] if line.strip()]
    return {row[0]: row[2] for row in rows}


class TinyRun(NamedTuple):
    home: Path
    proc: subprocess.CompletedProcess
    overrides: list[str]  # FAST plus the reference vocabulary: what every reuse must repeat
    reference_vocab: str
