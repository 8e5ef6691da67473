"""Run a long-lived command in a child process so that Ctrl-C and SIGTERM always stop it promptly.

`gristmill run`, `serve` and `refresh` are small supervisors: the work runs in a child in its own
session (flows/supervised.py), so a terminal's Ctrl-C reaches only the supervisor (not the
embedded Prefect server or Ray, which would otherwise die first and leave the run's crash report
retrying a dead API for minutes). On SIGINT or SIGTERM the supervisor forwards the signal once to
the child, which unwinds (stage `finally` blocks stop Ray; Prefect and MLflow record the run as
crashed/failed; a served runner pauses its deployments); whatever is still alive after `GRACE_S`
— the child, the Prefect server, Ray's processes, served flow runs — is killed, and the
supervisor exits 130 (SIGINT) or 143 (SIGTERM), whatever state the servers are in (a served
runner whose Prefect server is gone would retry for minutes). Nothing is lost: committed stages
stay in the artifact store and a stage in progress keeps its `.partial` directory and
checkpoints, so running the same command again resumes. A second Ctrl-C skips the grace period.

The child watches its supervisor: if the supervisor dies (even by `kill -9`), the child stops
the processes it started and exits, so no pipeline, Prefect server or Ray is left running
unattended.

The child gets a scratch folder of its own (`GRISTMILL_SCRATCH`, `scratch_dir()`), removed once
the child and what it started are gone, however they stopped; the child removes it itself when
its supervisor dies. A local Ray keeps its session folder there (infra/ray_engine.py), so no stop,
not even one that kills Ray before it has shut down, leaves it behind in the system temp folder.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from gristmill.infra.processes import ProcessTree, alive

GRACE_S = 7.0  # the child's time to unwind before everything left is killed; exit stays < 10 s
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
SUPERVISOR_ENV = "GRISTMILL_SUPERVISOR_PID"  # set in the child: whom to watch
SCRATCH_ENV = "GRISTMILL_SCRATCH"  # set in the child: its scratch folder
REMOVE_TRIES = 20  # 0.1 s apart: a process still exiting may write a last line where a folder goes
# How often the child's process tree is walked (which reads every process on the machine, on the
# cores the stage's workers use): its Ray and Prefect processes live for the whole run.
TREE_EVERY_S = 2.0


def die_with_supervisor(poll_s: float = 0.5) -> None:
    """In the pipeline child: when the supervisor named by $GRISTMILL_SUPERVISOR_PID is gone,
    kill what this process started and exit 137, as if killed along with it."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor:
        return
    try:
        watched = [psutil.Process(int(supervisor))]
    except psutil.NoSuchProcess:  # gone already
        watched = []

    def watch() -> None:
        while alive(watched):  # psutil compares start times: a reused pid is not the supervisor
            time.sleep(poll_s)
        ProcessTree(os.getpid()).kill(spare_root=True)
        if (scratch := scratch_dir()) is not None:
            remove_tree(scratch)
        os._exit(137)

    threading.Thread(target=watch, name="gristmill-supervisor-watch", daemon=True).start()


def supervise(argv: Sequence[str], poll_s: float = 0.5, stopped_note: str = "") -> int:
    """Run `argv` as the child; return its exit code, or 130/143 after a signal (then say so on
    stderr, with `stopped_note`)."""
    received: list[int] = []
    child: subprocess.Popen | None = None
    forwarded = False

    def forward() -> None:
        nonlocal forwarded
        if child is not None and received and not forwarded:
            forwarded = True
            child.send_signal(received[0])

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        forward()  # at once: the main loop may be asleep

    previous = {s: signal.signal(s, on_signal) for s in EXIT_CODES}
    scratch = Path(tempfile.mkdtemp(prefix="gristmill-"))
    try:
        environ = {**os.environ, SUPERVISOR_ENV: str(os.getpid()), SCRATCH_ENV: str(scratch)}
        child = subprocess.Popen(list(argv), start_new_session=True, env=environ)
        forward()  # a signal that came while the child was being started
        tree = ProcessTree(child.pid)
        deadline: float | None = None
        found_at = -math.inf
        while child.poll() is None:
            if time.monotonic() - found_at >= TREE_EVERY_S:
                tree.refresh()
                found_at = time.monotonic()
            if received and deadline is None:
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and (len(received) > 1 or time.monotonic() > deadline):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):  # returns as soon as the child exits
                child.wait(poll_s if deadline is None else 0.1)
        tree.kill()  # what the child left behind (or the child itself, past its grace)
        if received:
            name = signal.Signals(received[0]).name
            note = f"; {stopped_note}" if stopped_note else ""
            print(f"gristmill: stopped by {name}{note}", file=sys.stderr)
            return EXIT_CODES[signal.Signals(received[0])]
        # A child killed by a signal reports -N; a shell reports 128 + N.
        return child.returncode if child.returncode >= 0 else 128 - child.returncode
    finally:
        # Before the signal handlers go back, so a second Ctrl-C cannot cut it short.
        if child is None or child.poll() is not None:  # else still running: the folder is in use
            remove_tree(scratch)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def scratch_dir() -> Path | None:
    """This process's scratch folder, when a supervisor gave it one."""
    path = os.environ.get(SCRATCH_ENV)
    return Path(path) if path else None


def remove_tree(path: Path) -> None:
    """Remove `path` and everything below it, again while something still writes there."""
    for _ in range(REMOVE_TRIES):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.1)
