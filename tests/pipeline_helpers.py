"""Running the real `gristmill` CLI from tests: one tiny-pipeline configuration for every
end-to-end test, so they share one run (the `tiny_run` fixture in conftest.py)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from bench.harness.runs import REPO, STAGES, cli_env, committed_dir, committed_files, manifest_files
from bench.harness.runs import SHORT as FAST

# What end-to-end tests import from here: bench/harness/runs.py's helpers, shared with the benchmarks, and these.
__all__ = ["FAST", "REPO", "STAGES", "TinyRun", "checkpoint_steps", "cli_env", "committed_dir", "committed_files",
           "gristmill", "manifest_files", "plan_of"]


def gristmill(home: Path, *args: str, timeout: int = 1200,
              services: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`gristmill ARGS` in `home`, with the external services `services` (see cli_env); asserts it
    succeeded."""
    proc = subprocess.run([sys.executable, "-m", "gristmill", *args], cwd=REPO, env=cli_env(home, services),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"gristmill {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def plan_of(home: Path, overrides: list[str], *more: str, services: dict[str, str] | None = None) -> dict[str, str]:
    """stage -> 'reuse' | 'run', as printed by --dry-run."""
    out = gristmill(home, "run", "configs/tiny.yaml", *overrides, *more, "--dry-run", services=services).stdout
    rows = [line.split() for line in out.split("# plan", 1)[1].splitlines()[1:] if line.strip()]
    return {row[0]: row[2] for row in rows}


def checkpoint_steps(home: Path) -> list[int]:
    """Steps of pretraining's complete checkpoints in progress in `home` (step 0 is the rollback
    target, not progress)."""
    found = (home / "artifacts" / "pretrain").glob("*.partial/checkpoints/step-*/checkpoint.json")
    return sorted(step for step in (int(p.parent.name.split("-")[1]) for p in found) if step > 0)


class TinyRun(NamedTuple):
    home: Path
    proc: subprocess.CompletedProcess
    overrides: list[str]  # FAST plus the reference vocabulary: what every reuse must repeat
    reference_vocab: str
    # stage -> its committed directory, recorded right after the run: later tests add other
    # artifacts of some stages to the same home (other methods, the preset's own SFT)
    committed: dict[str, Path]

    def home_with(self, home: Path, stages: tuple[str, ...] = STAGES) -> Path:
        """A fresh `home` holding copies of this run's committed artifacts of `stages`."""
        for stage in stages:
            source = self.committed[stage]
            shutil.copytree(source, home / "artifacts" / stage / source.name)
        return home
