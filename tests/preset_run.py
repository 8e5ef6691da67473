"""The tiny preset as shipped (its full pretraining and SFT), aligned with each method: the run the
learning claims of tests/flows/test_pipeline_e2e.py read. It is the longest run of the session and
needs nothing the other tests make, so conftest.py starts it in the background as soon as tests
that need it are collected, at a lower CPU priority (`nice`): it takes the cycles the other tests
leave idle (on 2 cores, a third of them), and the claims' module, ordered last, waits for what is
left of it. Each command is the real CLI in a home of its own, with its own Prefect server."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from pipeline_helpers import REPO, cli_env

METHODS = ("grpo", "dpo", "ppo")
# Every method trains data-parallel, 2 processes under Accelerate: the launch is not part of the
# key, and the claims must hold under it.
TWO_PROCESSES = ["align.launch.backend=accelerate", "align.launch.processes=2"]
NICENESS = 10


class PresetRun:
    """`gristmill run configs/tiny.yaml align.method=M ... --until align` for each method in turn,
    in a thread: the first computes collect to SFT, the others reuse them."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gristmill-preset-"))
        self.home = self.root / "home"
        self._thread = threading.Thread(target=self._run, name="preset-run", daemon=True)
        self._proc: subprocess.Popen | None = None
        self._stopping = False
        self.failure: str | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        for method in METHODS:
            if self._stopping:
                return
            args = ["run", "configs/tiny.yaml", f"align.method={method}", *TWO_PROCESSES, "--until", "align"]
            log = self.root / f"{method}.log"
            with log.open("w") as out:
                self._proc = subprocess.Popen(["nice", "-n", str(NICENESS), sys.executable, "-m", "flows.cli", *args],
                                              cwd=REPO, env=cli_env(self.home), stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True)
                code = self._proc.wait()
            if code != 0 or self._stopping:
                self.failure = f"gristmill {' '.join(args)} exited {code}:\n{log.read_text()[-6000:]}"
                return

    def wait(self, timeout: float = 2400) -> Path:
        """The home, once every method has run; fails with the failing run's output."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the preset's runs did not finish within {timeout:.0f} s"
        assert self.failure is None, self.failure
        return self.home

    def stop(self) -> None:
        """Whatever still runs is stopped (SIGTERM to its session: the CLI stops what it started),
        and the folder removed."""
        self._stopping = True
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
        self._thread.join(60)
        shutil.rmtree(self.root, ignore_errors=True)
