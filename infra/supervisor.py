"""Run the pipeline in a child process so that Ctrl-C and SIGTERM always stop it promptly.

`gristmill run` is a small supervisor: the pipeline runs in a child in its own session, so a
terminal's Ctrl-C reaches only the supervisor (not the embedded Prefect server or Ray, which
would otherwise die first and leave the run's crash report retrying a dead API for minutes).
On SIGINT or SIGTERM the supervisor forwards the signal once to the child, which unwinds (stage
`finally` blocks stop Ray; Prefect and MLflow record the run as crashed/failed); whatever is
still alive after `GRACE_S` — the child, the Prefect server, Ray's processes — is killed, and
the supervisor exits 130 (SIGINT) or 143 (SIGTERM). Nothing is lost: committed stages stay in
the artifact store and a stage in progress keeps its `.partial` directory and checkpoints, so
running the same command again resumes. A second Ctrl-C skips the grace period.

The child watches its supervisor: if the supervisor dies (even by `kill -9`), the child stops
the processes it started and exits, so no pipeline, Prefect server or Ray is left running
unattended.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Iterable, Sequence

import psutil

if TYPE_CHECKING:
    from infra.warm import WarmChild

GRACE_S = 7.0  # the child's time to unwind before everything left is killed; exit stays < 10 s
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
SUPERVISOR_ENV = "GRISTMILL_SUPERVISOR_PID"  # set in the child: whom to watch


def process_tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its descendants, now."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def alive(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (zombies are done). psutil.Process compares create
    times, so a reused pid is never mistaken for one of ours."""
    def running(proc: psutil.Process) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # gone between the two questions
            return False
    return [p for p in processes if running(p)]


def kill_all(processes: Iterable[psutil.Process], timeout: float = 2) -> None:
    """SIGKILL whatever of `processes` still runs and wait up to `timeout` for them to go."""
    doomed = alive(processes)
    for proc in doomed:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(doomed, timeout=timeout)


class _Tree:
    """Every process the child has started, remembered across polls: Ray workers and the Prefect
    server may be re-parented or in their own process groups by the time we stop them."""

    def __init__(self, root_pid: int):
        try:
            self.root: psutil.Process | None = psutil.Process(root_pid)
        except psutil.NoSuchProcess:  # a child forked by the warm runner may be gone (and reaped) already
            self.root = None
        self.known: dict[int, psutil.Process] = {root_pid: self.root} if self.root else {}

    def refresh(self) -> None:
        if self.root is None:
            return
        try:
            for proc in self.root.children(recursive=True):
                self.known.setdefault(proc.pid, proc)
        except psutil.NoSuchProcess:
            pass

    def kill(self, spare_root: bool = False) -> None:
        self.refresh()
        kill_all(p for p in self.known.values() if not (spare_root and p is self.root))


def die_with_supervisor(poll_s: float = 0.5) -> None:
    """In the pipeline child: when the supervisor named by $GRISTMILL_SUPERVISOR_PID is gone,
    kill what this process started and exit 137, as if killed along with it."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor:
        return
    try:  # the supervisor is not always our parent: the warm runner (infra/warm.py) forks us
        watched = [psutil.Process(int(supervisor))]
    except psutil.NoSuchProcess:
        watched = []

    def watch() -> None:
        while alive(watched):  # psutil compares start times: a reused pid is not the supervisor
            time.sleep(poll_s)
        _Tree(os.getpid()).kill(spare_root=True)
        os._exit(137)

    threading.Thread(target=watch, name="gristmill-supervisor-watch", daemon=True).start()


def supervise(argv: Sequence[str], poll_s: float = 0.5, warm_args: Sequence[str] | None = None) -> int:
    """Run `argv` as the pipeline child; return its exit code, or 130/143 after a signal. With
    `warm_args` (the child's `gristmill` arguments), the home's warm runner forks the child when
    it can (infra/warm.py), else `argv` starts as a fresh process."""
    received: list[int] = []
    child: subprocess.Popen | WarmChild | None = None
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
    try:
        environ = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
        if warm_args is not None:
            from infra.warm import fork_run

            child = fork_run(list(warm_args), environ)
        if child is None:
            child = subprocess.Popen(list(argv), start_new_session=True, env=environ)
        forward()  # a signal that came while the child was being started
        tree = _Tree(child.pid)
        deadline: float | None = None
        while child.poll() is None:
            tree.refresh()
            if received and deadline is None:
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and (len(received) > 1 or time.monotonic() > deadline):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):  # returns as soon as the child exits
                child.wait(poll_s if deadline is None else 0.1)
        tree.kill()  # what the child left behind (or the child itself, past its grace)
        if received:
            name = signal.Signals(received[0]).name
            print(f"gristmill: stopped by {name}; finished stages and checkpoints are kept, "
                  "run the same command again to resume", file=sys.stderr)
            return EXIT_CODES[received[0]]
        # A child killed by a signal reports -N; a shell reports 128 + N.
        return child.returncode if child.returncode >= 0 else 128 - child.returncode
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
