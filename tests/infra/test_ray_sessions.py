"""A stopped run leaves no Ray session folder behind: not when Ctrl-C comes while its Ray starts,
not when its pipeline dies in a stage's commit window, not in the shared /tmp/ray (other runs on the
machine may have theirs there: only this run's count) and not in the scratch folder its supervisor
gave it (infra/supervisor.py), which goes too, however the child ended."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pipeline_helpers import FAST, REPO, cli_env

from gristmill.infra.processes import alive, process_tree
from gristmill.infra.supervisor import SCRATCH_ENV

SHARED_RAY_TEMP = Path("/tmp/ray")


def _sessions_of(pids: set[int]) -> set[Path]:
    """Session folders in the shared /tmp/ray of a Ray started by one of `pids` (a session's name
    ends with its driver's pid)."""
    return {p for p in SHARED_RAY_TEMP.glob("session_2*") if p.name.rsplit("_", 1)[-1] in {str(pid) for pid in pids}}


def _ray_sessions(processes: list[psutil.Process]) -> set[Path]:
    """The session folders that the Ray processes among `processes` were started with."""
    found = set()
    for proc in processes:
        try:
            args = proc.cmdline()
        except psutil.Error:  # gone meanwhile
            continue
        found |= {Path(arg.split("=", 1)[1]) for arg in args if arg.startswith(("--session-dir=", "--session_dir="))}
    return found


def _scratch_in(processes: list[psutil.Process]) -> Path | None:
    """The scratch folder the supervisor gave its child, from the environment of the child or of
    what it started."""
    for proc in processes:
        try:
            if SCRATCH_ENV in (environ := proc.environ()):
                return Path(environ[SCRATCH_ENV])
        except psutil.Error:  # gone, or not yet started
            continue
    return None


def _start(home: Path, *args: str, extra: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *FAST, *args],
                            cwd=REPO, env=cli_env(home, extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _watch(proc: subprocess.Popen, until, timeout: float = 300) -> tuple[set[Path], set[int], Path | None]:
    """Until `until(sessions)` or the run's end: the Ray session folders its processes were started
    with, every pid its tree had, and the pipeline child's scratch folder."""
    sessions: set[Path] = set()
    pids: set[int] = set()
    scratch = None
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not until(sessions):
        assert time.monotonic() < deadline, "the run neither started Ray nor ended"
        try:
            tree = process_tree(proc.pid)
        except psutil.NoSuchProcess:
            break
        pids |= {p.pid for p in tree}
        sessions |= _ray_sessions(tree)
        scratch = scratch or _scratch_in(tree[1:])
        time.sleep(0.05)
    return sessions, pids, scratch


def _assert_nothing_left(sessions: set[Path], pids: set[int], scratch: Path | None) -> None:
    assert sessions, "Ray was never seen starting"
    assert scratch is not None and all(scratch in s.parents for s in sessions), (scratch, sessions)
    left = [s for s in sessions if s.exists()]
    assert not left, f"session folders left behind: {left}"
    assert not _sessions_of(pids), f"in the shared {SHARED_RAY_TEMP}: {_sessions_of(pids)}"
    assert not scratch.exists(), f"the run's scratch folder is left: {sorted(scratch.rglob('*'))[:10]}"


@pytest.mark.slow
def test_ctrl_c_while_ray_starts_and_a_kill_in_the_commit_window_leave_no_session_folder(prefect_server, tmp_path):
    """Ctrl-C as soon as the run's first Ray process is up (Ray is still starting); then, in the
    same home, the run that resumes collect dies (SIGKILL: GRISTMILL_FAULT) in its commit window.
    Whatever state Ray is in, its folder goes, and so does the run's scratch folder. Both runs use
    the session's standing Prefect server: what is checked is Ray's and the scratch folder's, and
    an interrupted run's own Prefect server going too is tests/infra/test_interrupts.py's."""
    home = tmp_path / "home"
    proc = _start(home, "--until", "collect", extra=prefect_server)
    sessions, pids, scratch = _watch(proc, until=bool)
    assert proc.poll() is None, f"the run ended before Ray started:\n{proc.stdout.read()[-3000:]}"
    processes = process_tree(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole foreground group
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    time.sleep(0.5)  # the kernel's bookkeeping of the last SIGKILLs
    assert not alive(processes), [" ".join(p.cmdline()[:3]) for p in alive(processes)]
    _assert_nothing_left(sessions, pids, scratch)

    proc = _start(home, "--until", "collect", extra={**prefect_server, "GRISTMILL_FAULT": "commit:collect"})
    sessions, pids, scratch = _watch(proc, until=lambda _: False)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert list((home / "artifacts" / "collect").glob("*.partial/manifest.json")), "not killed in the commit window"
    _assert_nothing_left(sessions, pids, scratch)


CHILD = """
import os, signal, sys, time
from pathlib import Path
scratch = Path(os.environ["GRISTMILL_SCRATCH"])
(scratch / "ray-x" / "session_2").mkdir(parents=True)
(scratch / "ray-x" / "session_2" / "log").write_text("a Ray the child never stopped")
Path(sys.argv[2]).write_text(str(scratch))
if sys.argv[1] == "SIGKILL":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_the_supervisor_removes_its_childs_scratch_folder_however_it_stops(stop, tmp_path):
    """The child dies by itself (SIGKILL) or is stopped through the supervisor (SIGTERM, Ctrl-C)
    without cleaning up: the scratch folder it was given is gone when `supervise` returns."""
    out = tmp_path / "scratch-path"
    runner = ("import sys; from gristmill.infra.supervisor import supervise; "
              f"sys.exit(supervise([sys.executable, '-c', {CHILD!r}, {stop!r}, {str(out)!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", runner], cwd=REPO, start_new_session=True,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    scratch = Path(out.read_text())
    if stop != "SIGKILL":  # (that child is gone already, and perhaps its folder)
        assert (scratch / "ray-x" / "session_2" / "log").exists()
        proc.send_signal(getattr(signal, stop))
    rc = proc.wait(timeout=30)
    assert rc == {"SIGKILL": 128 + 9, "SIGTERM": 143, "SIGINT": 130}[stop]
    assert not scratch.exists()
