"""Ctrl-C and SIGTERM stop `gristmill run` within 10 s with exit 130/143, kill -9 of the whole job
takes the pipeline child with it, no process is left behind, and the next run resumes (pretraining
from its last checkpoint, not step 0) to the same artifacts an uninterrupted run made (the shared
tiny run)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pipeline_helpers import REPO, checkpoint_steps, cli_env, committed_dir, committed_files, gristmill, manifest_files

from gristmill.infra.processes import alive, process_tree

pytestmark = pytest.mark.slow

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 900, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the fault point"
        assert time.monotonic() < deadline, "fault point not reached"
        time.sleep(poll_s)


def _freeze(supervisor: int) -> list[int]:
    """SIGSTOP the supervisor's process group, then its pipeline child's (a session of its own);
    return the groups, the child's first, in the order they are to be resumed."""
    os.killpg(supervisor, signal.SIGSTOP)
    groups = [os.getpgid(child.pid) for child in psutil.Process(supervisor).children()]
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    return [*groups, supervisor]


def _interrupt(home: Path, overrides: list[str], stage: str, ready, signum: int,
               settle_s: float = 0.0, services: dict[str, str] | None = None) -> str:
    """Start a run (with the external `services`, else the embedded ones), wait until
    `ready(partial_dir)` and `settle_s` more, send `signum` the way a user does (Ctrl-C: to the
    terminal's process group; SIGTERM: to the process), check how it stopped, and return what the
    run printed. The job is frozen (SIGSTOP) at the fault point while its processes are listed, and
    the signal lands as it resumes: a stage as short as the tiny tokenizer's cannot finish in between."""
    log = home.parent / f"{stage}-{signum}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml",
                                 *overrides, "--until", "sft"], cwd=REPO, env=cli_env(home, services),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        stage_dir = home / "artifacts" / stage
        _wait_for(lambda: any(ready(p) for p in stage_dir.glob("*.partial")), proc, poll_s=0.02)
        time.sleep(settle_s)
        frozen = _freeze(proc.pid)
        assert list(stage_dir.glob("*.partial")), "the stage ended before the fault point"
        processes = process_tree(proc.pid)  # the supervisor, the pipeline, Prefect's server, Ray
        started = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        for group in frozen:
            os.killpg(group, signal.SIGCONT)
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
    return checkpoint_steps(partial.parent.parent.parent) != []


def _kill9_after_a_new_checkpoint(home: Path, overrides: list[str]) -> int:
    """Start a run, wait for a pretraining checkpoint newer than those there, then kill -9 the
    whole `gristmill run` job, as a lost machine would: the pipeline child must follow its
    supervisor, leave no process behind and commit nothing. Returns the newest checkpoint's step."""
    before = max(checkpoint_steps(home), default=0)
    proc = subprocess.Popen([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *overrides,
                             "--until", "sft"], cwd=REPO, env=cli_env(home), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for(lambda: max(checkpoint_steps(home), default=0) > before, proc)
    processes = process_tree(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # the child notices within half a second, then stops what it started: all gone within 3 s,
    # asked every 0.2 s rather than waited out
    deadline = time.monotonic() + 3
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [" ".join(p.cmdline()[:4]) for p in left]
    assert not list((home / "artifacts" / "pretrain").glob("*/manifest.json"))
    return max(checkpoint_steps(home))


def test_signals_at_several_stages_stop_fast_and_the_next_run_resumes_identically(tiny_run, prefect_server,
                                                                                tmp_path):
    home = tmp_path / "home"
    overrides = tiny_run.overrides
    # Ctrl-C while collect's Ray actors work; Ctrl-C while the tokenizer trains; SIGTERM in
    # pretraining after a checkpoint; kill -9 after a later one. (The tiny SFT, 30 steps, is over
    # in seconds: too short to interrupt on purpose.) Checkpoints come more often in the
    # interrupted runs (an operational knob, not part of the key) so both pretraining faults fit
    # in its 60 steps; the final run uses the shared run's config and commits the same files.
    # Ctrl-C in collect and the kill -9 hit runs with their embedded Prefect server, which must go
    # too; the other runs use the session's standing server, which saves each its start-up.
    text = _interrupt(home, overrides, "collect", Path.exists, signal.SIGINT, settle_s=3)
    assert "stopped by SIGINT" in text
    # the tiny tokenizer trains for about a second of a two-second stage: Ctrl-C as soon as it starts
    text = _interrupt(home, overrides, "tokenize", Path.exists, signal.SIGINT, services=prefect_server)
    assert "collect-" in text and "resuming from the partial output" in text, text[-3000:]
    often = [*overrides, "pretrain.checkpoint_every=20"]
    _interrupt(home, often, "pretrain", _has_checkpoint, signal.SIGTERM, services=prefect_server)
    killed_at = _kill9_after_a_new_checkpoint(home, often)
    log = gristmill(home, "run", "configs/tiny.yaml", *overrides, "--until", "sft", services=prefect_server)
    text = log.stdout + log.stderr
    assert "collect: reused" in text and "tokenize: reused" in text, text[-3000:]
    assert "resuming from step" in text, text[-3000:]
    step = int(text.split("resuming from step", 1)[1].split()[0].strip(".,:"))
    assert step >= killed_at
    assert "sft: done in" in text
    pretrain = json.loads((committed_dir(home, "pretrain") / "manifest.json").read_text())
    assert pretrain["stats"]["resumed_from_step"] == step
    for stage in ("collect", "tokenize", "pretrain", "sft"):
        assert committed_files(home, stage) == manifest_files(tiny_run.committed[stage]), stage
