"""The warm runner (flows/runner.py, infra/warm.py), a real one in a home of its own: `gristmill run`
forks its pipeline child from it, with the caller's terminal and exit code; a caller with other
settings or changed code gets a fresh process instead; Ctrl-C stops a forked run and all it
started."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_helpers import REPO, cli_env

from infra import warm
from infra.supervisor import alive, kill_all, process_tree

pytestmark = pytest.mark.slow
BAD_CONFIG = ["run", "configs/tiny.yaml", "pretrain.no_such_key=1"]


class Runner:
    def __init__(self, home: Path):
        self.home, self.log = home, home / "runner.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "flows.runner", str(home)], cwd=home,
                                         env=cli_env(home), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.wait_ready()

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not warm.ping(warm.socket_path(self.home)):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the runner did not come up"
            time.sleep(0.2)

    def said(self) -> str:
        return self.log.read_text()

    def forked(self) -> list[int]:
        return [int(pid) for pid in re.findall(r"forked pid (\d+)", self.said())]


@pytest.fixture
def runner(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    started = Runner(home)
    yield started
    kill_all(process_tree(started.proc.pid))


def _gristmill(home: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO,
                          env=cli_env(home, extra_env), capture_output=True, text=True, timeout=300)


def test_a_run_forks_from_the_runner_with_the_callers_terminal_and_exit_code(runner):
    done = _gristmill(runner.home, *BAD_CONFIG)
    # the fork wrote to the caller's stderr, and its exit code came back through the runner
    assert done.returncode == 2 and "unknown config key 'pretrain.no_such_key'" in done.stderr, done
    assert len(runner.forked()) == 1 and "pretrain.no_such_key=1" in runner.said()
    # Other settings than the runner imported with: a fresh process, the same answer.
    done = _gristmill(runner.home, *BAD_CONFIG, PREFECT_LOGGING_LEVEL="DEBUG")
    assert done.returncode == 2 and "unknown config key" in done.stderr, done
    assert len(runner.forked()) == 1 and "refused a run (other settings in the environment)" in runner.said()
    done = _gristmill(runner.home, *BAD_CONFIG, GRISTMILL_WARM="0")  # asked not to fork
    assert done.returncode == 2 and len(runner.forked()) == 1


def test_changed_code_is_never_run_warm_and_the_runner_starts_again(runner):
    source = REPO / "flows" / "dag.py"  # imported by the runner
    stat = source.stat()
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        done = _gristmill(runner.home, *BAD_CONFIG)
        assert done.returncode == 2 and "unknown config key" in done.stderr, done
        assert runner.forked() == [] and "code or the installed packages changed" in runner.said()
        runner.wait_ready()  # the same process, started again with the code as it is now
        assert runner.proc.poll() is None
        done = _gristmill(runner.home, *BAD_CONFIG)
        assert done.returncode == 2 and len(runner.forked()) == 1, runner.said()
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_ctrl_c_stops_a_forked_run_and_everything_it_started(runner):
    log = runner.home.parent / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml",
                                 "--until", "collect"], cwd=REPO, env=cli_env(runner.home),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    partial = runner.home / "artifacts" / "collect"
    while not list(partial.glob("*.partial")) or not runner.forked():  # collect is computing
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "collect did not start"
        time.sleep(0.2)
    time.sleep(2)
    [pid] = runner.forked()
    processes = process_tree(pid)  # the forked pipeline, Prefect's server, Ray
    assert len(processes) > 1
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the supervisor only
    rc = proc.wait(timeout=60)
    assert rc == 130 and time.monotonic() - started < 10, (rc, log.read_text()[-3000:])
    time.sleep(0.5)
    assert not alive(processes), [" ".join(p.cmdline()[:4]) for p in alive(processes)]
    assert "stopped by SIGINT" in log.read_text()
    assert warm.ping(warm.socket_path(runner.home))  # the runner itself goes on


def test_a_child_gone_before_the_supervisor_looks_is_no_error():
    """A forked run may end, and be reaped by the runner, before its supervisor first looks at
    it (a config error takes a fraction of a second)."""
    from infra.supervisor import _Tree

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tree = _Tree(gone.pid)
    tree.refresh()
    tree.kill()
    assert tree.known == {}
