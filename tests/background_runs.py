"""The session's two whole runs of the pipeline, started in the background as soon as the tests
that need them are collected (conftest.py), each at a lower CPU priority (`nice`): on 2 cores the
other tests leave about a third of the cycles idle, and these runs take them. A test that needs
one waits for what is left of it.

- The shared tiny run (`tiny_run`): the tiny preset shortened (flows/runs.py SHORT), every stage,
  in a fresh home; the end-to-end tests read it or start from copies of its artifacts.
- The preset run (`preset_run`): the tiny preset as shipped (its full pretraining and SFT),
  aligned with each method, for the learning claims of tests/flows/test_pipeline_e2e.py; the
  longest run of the session, needed last.

Each command is the real CLI in a home of its own, with its own Prefect server."""
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

from pipeline_helpers import FAST, REPO, cli_env

# The shared run yields to the other tests, the preset run to both (it is needed last).
TINY_NICENESS, PRESET_NICENESS = 5, 10
METHODS = ("grpo", "dpo", "ppo")
# Every method trains data-parallel, 2 processes under Accelerate: the launch is not part of the
# key, and the claims must hold under it.
TWO_PROCESSES = ["align.launch.backend=accelerate", "align.launch.processes=2"]


def tiny_overrides(shared_data: Path) -> tuple[list[str], str]:
    """The shared run's overrides, and among them the reference vocabulary: FAST, compression next
    to GPT-2's vocabulary, two real benchmarks of 20 items each (scores, contamination and the
    report card end to end)."""
    reference_vocab = f"tokenize.reference_vocab={shared_data / 'tokenizer' / 'gpt2.tiktoken'}"
    eval_dir = shared_data / "eval"
    benchmarks = (f"evaluate.tasks=[{eval_dir / 'hellaswag' / 'hellaswag_val_part1.jsonl'},"
                  f"{eval_dir / 'arc_easy' / 'arc_easy_part1.jsonl'}]")
    return [*FAST, reference_vocab, benchmarks, "evaluate.limit=20"], reference_vocab


class BackgroundRuns:
    """`gristmill ARGS` for each of `commands` in turn, in a thread, in one fresh home; each one's
    stdout and stderr kept apart, as `subprocess.run` keeps them."""

    def __init__(self, name: str, commands: list[list[str]], niceness: int):
        self.root = Path(tempfile.mkdtemp(prefix=f"gristmill-{name}-"))
        self.home = self.root / "home"
        self.commands, self.niceness = commands, niceness
        self.done: list[subprocess.CompletedProcess] = []
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-run", daemon=True)
        self._proc: subprocess.Popen | None = None
        self._stopping = False

    def start(self) -> BackgroundRuns:
        self._thread.start()
        return self

    def _run(self) -> None:
        for i, args in enumerate(self.commands):
            if self._stopping:
                return
            out, err = self.root / f"{i}.out", self.root / f"{i}.err"
            with out.open("w") as stdout, err.open("w") as stderr:
                self._proc = subprocess.Popen(["nice", "-n", str(self.niceness), sys.executable, "-m", "flows.cli",
                                               *args], cwd=REPO, env=cli_env(self.home), stdout=stdout,
                                              stderr=stderr, text=True, start_new_session=True)
                code = self._proc.wait()
            self.done.append(subprocess.CompletedProcess(args, code, out.read_text(), err.read_text()))
            if code != 0:
                self.failure = (f"gristmill {' '.join(args)} exited {code}:\n{self.done[-1].stdout[-3000:]}\n"
                                f"{self.done[-1].stderr[-6000:]}")
                return

    def wait(self, timeout: float = 2400) -> list[subprocess.CompletedProcess]:
        """Every command's result, once all have run; fails with the failing one's output."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.commands} did not finish within {timeout:.0f} s"
        assert self.failure is None, self.failure
        return self.done

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


def tiny_runs(shared_data: Path) -> BackgroundRuns:
    """The shared run, after a dry run that must plan every stage to run in the fresh home."""
    overrides, _ = tiny_overrides(shared_data)
    return BackgroundRuns("tiny", [["run", "configs/tiny.yaml", *overrides, "--dry-run"],
                                   ["run", "configs/tiny.yaml", *overrides]], TINY_NICENESS)


def preset_runs() -> BackgroundRuns:
    """Each align method in turn: the first computes collect to SFT, the others reuse them."""
    return BackgroundRuns("preset", [["run", "configs/tiny.yaml", f"align.method={method}", *TWO_PROCESSES,
                                      "--until", "align"] for method in METHODS], PRESET_NICENESS)
