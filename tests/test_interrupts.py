"""Ctrl-C and SIGTERM stop `gristmill run` within 10 s with exit 130/143, leave no process behind,
and the next run resumes to the same artifacts an uninterrupted run made (the shared tiny run)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_helpers import REPO, cli_env, committed_files, gristmill

from infra.processes import alive, process_tree

pytestmark = pytest.mark.slow

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the fault point"
        assert time.monotonic() < deadline, "fault point not reached"
        time.sleep(0.2)


def _interrupt(home: Path, overrides: list[str], stage: str, ready, signum: int,
               settle_s: float = 0.0) -> str:
    """Start a run, wait until `ready(partial_dir)` and `settle_s` more, send `signum` the way a
    user does (Ctrl-C: to the terminal's process group; SIGTERM: to the process), check how it
    stopped, and return what the run printed."""
    log = home.parent / f"{stage}-{signum}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml",
                                 *overrides, "--until", "sft"], cwd=REPO, env=cli_env(home),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        stage_dir = home / "artifacts" / stage
        _wait_for(lambda: any(ready(p) for p in stage_dir.glob("*.partial")), proc)
        time.sleep(settle_s)
        processes = process_tree(proc.pid)  # the supervisor, the pipeline, Prefect's server, Ray
        started = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        rc = proc.wait(timeout=60)
        seconds = time.monotonic() - started
    text = log.read_text()
    assert rc == EXIT_CODES[signum] and seconds < 10, (rc, seconds, text[-3000:])
    time.sleep(0.5)  # the kernel's bookkeeping of the last SIGKILLs
    left = alive(processes)
    assert not left, [" ".join(p.cmdline()[:4]) for p in left]
    assert list(stage_dir.glob("*.partial")), "the stage's partial output must be kept to resume"
    return text


def _has_checkpoint(partial: Path) -> bool:
    return any(p.parent.name != "step-0000000" for p in partial.glob("checkpoints/step-*/checkpoint.json"))


def test_signals_at_several_stages_stop_fast_and_the_next_run_resumes_identically(tiny_run, tmp_path):
    home = tmp_path / "home"
    overrides = tiny_run.overrides
    # Ctrl-C while collect's Ray actors work; Ctrl-C while the tokenizer trains; SIGTERM in
    # pretraining after a checkpoint. (The tiny SFT, 30 steps, is over in ~2 s: too short to
    # interrupt on purpose.)
    text = _interrupt(home, overrides, "collect", Path.exists, signal.SIGINT, settle_s=3)
    assert "stopped by SIGINT" in text
    text = _interrupt(home, overrides, "tokenize", Path.exists, signal.SIGINT, settle_s=2)
    assert "collect-" in text and "resuming from the partial output" in text, text[-3000:]
    _interrupt(home, overrides, "pretrain", _has_checkpoint, signal.SIGTERM)
    log = gristmill(home, "run", "configs/tiny.yaml", *overrides, "--until", "sft")
    text = log.stdout + log.stderr
    assert "pretrain-" in text and "resuming from step" in text, text[-3000:]
    assert "sft: done in" in text
    for stage in ("collect", "tokenize", "pretrain", "sft"):
        assert committed_files(home, stage) == committed_files(tiny_run.home, stage), stage
