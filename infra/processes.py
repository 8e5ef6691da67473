"""The processes gristmill starts, found and stopped as a whole: a process with all its
descendants (a run's pipeline child, the Prefect server and Ray it started), or a session that
`gristmill up` started (a server with its workers).

psutil.Process compares start times, so a pid the system has since given to another process is
never taken for one of ours.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its descendants, now."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def alive(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (zombies are done)."""
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
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(doomed, timeout=timeout)


class ProcessTree:
    """Every process started under `root_pid`, remembered across `refresh` calls: Ray workers
    and the Prefect server may be re-parented by the time they are stopped."""

    def __init__(self, root_pid: int):
        self.root = psutil.Process(root_pid)
        self.known: dict[int, psutil.Process] = {root_pid: self.root}

    def refresh(self) -> None:
        try:
            for proc in self.root.children(recursive=True):
                self.known.setdefault(proc.pid, proc)
        except psutil.NoSuchProcess:
            pass

    def kill(self, spare_root: bool = False) -> None:
        self.refresh()
        kill_all(p for p in self.known.values() if not (spare_root and p is self.root))


def recorded(pid: int, create_time: float) -> psutil.Process | None:
    """The process `pid` created at `create_time` if it still runs; a reused pid is not it."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) < 0.01 and alive([proc]):
            return proc
    except psutil.Error:
        pass
    return None


def session(pid: int, create_time: float) -> list[psutil.Process]:
    """Every process of the session that `pid` (created at `create_time`) leads, plus its
    descendants that left the session. Only processes created no earlier than the leader: a
    reused session id is never taken for ours."""
    leader = recorded(pid, create_time)
    if leader is None and psutil.pid_exists(pid):
        # Linux frees a pid only once no process uses it as a session id: a live process with
        # our leader's pid means the pid was reused and the session is someone else's.
        return []
    members: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == pid and proc.create_time() >= create_time - 0.01:
                members[proc.pid] = proc
        except (OSError, psutil.Error):  # gone meanwhile, or not ours to look at
            continue
    if leader is not None:
        for child in leader.children(recursive=True):
            members.setdefault(child.pid, child)
    return list(members.values())


def stop_sessions(leaders: Iterable[tuple[int, float]], grace_s: float) -> None:
    """SIGTERM the whole sessions of `leaders` (pid, create time) at once, SIGKILL what is left
    after `grace_s`, children started meanwhile included."""
    leaders = list(leaders)
    members = alive([p for leader in leaders for p in session(*leader)])
    for proc in members:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, left = psutil.wait_procs(members, timeout=grace_s)
    kill_all(left + alive([p for leader in leaders for p in session(*leader)]))


def interrupt(process: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a `gristmill` command we started as Ctrl-C would (SIGINT: it shuts down what it
    started), and SIGKILL it if it has not ended after `grace_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
