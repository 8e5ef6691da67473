"""kill -9 in the middle of pretraining, then the same command again: pretraining resumes from its
last checkpoint (not step 0), finished stages are reused, and no half-written artifact is taken
as complete."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_helpers import REPO, gristmill

from infra.processes import alive, process_tree

pytestmark = pytest.mark.slow
ARGS = ["run", "configs/tiny.yaml", "--until", "pretrain", "pretrain.max_steps=80",
        "pretrain.checkpoint_every=20"]


def _checkpoints(home: Path) -> list[Path]:
    return sorted((home / "artifacts" / "pretrain").glob("*.partial/checkpoints/step-*"))


def _start(home: Path) -> subprocess.Popen:
    env = {**os.environ, "GRISTMILL_HOME": str(home)}
    # A session of its own, so the kill takes the whole job (Prefect server, Ray) down at once.
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *ARGS], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def test_kill_during_pretraining_then_resume(tmp_path):
    home = tmp_path / "home"
    proc = _start(home)
    deadline = time.time() + 900
    while len(_checkpoints(home)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert proc.poll() is None, "the run ended before it could be killed mid-pretraining"
    assert len(_checkpoints(home)) >= 2, "no checkpoints appeared in time"
    processes = process_tree(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)  # `gristmill run` killed: the pipeline child must follow
    proc.wait()
    time.sleep(3)  # the child notices within half a second, then stops what it started
    left = alive(processes)
    assert not left, [" ".join(p.cmdline()[:4]) for p in left]
    assert not list((home / "artifacts" / "pretrain").glob("*/manifest.json"))
    killed_at = max(int(p.name.split("-")[1]) for p in _checkpoints(home))
    assert killed_at > 0

    resumed = gristmill(home, *ARGS)
    log = resumed.stdout + resumed.stderr
    assert "collect: reused" in log and "tokenize: reused" in log
    assert "resuming from step" in log
    step = int(log.split("resuming from step", 1)[1].split()[0].strip(".,:"))
    assert step >= killed_at
    manifest = next((home / "artifacts" / "pretrain").glob("*/manifest.json"))
    import json
    stats = json.loads(manifest.read_text())["stats"]
    assert stats["resumed_from_step"] == step
