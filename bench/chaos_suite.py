"""The fault suite's runs and homes (bench/chaos.py): a trial's outcome (`Trial`), one `gristmill run`
in a session of its own (`Run`), and the `Suite` that holds the reference run, gives each trial a
home seeded with the reference's upstream stages, and compares what a trial committed with the
reference. The faults themselves are in bench/chaos_faults.py.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.harness.runs import REPO, STAGES, cli_env, committed_dir, committed_files
from gristmill.infra.processes import process_tree


@dataclass(kw_only=True)
class Trial:
    fault: str
    stage: str
    survived: bool
    identical: bool | None  # None: nothing to compare (fuzz)
    docs_lost: int
    note: str


class Run:
    """One `gristmill run` of the suite's config in `home`, started in a session of its own."""

    def __init__(self, bench: Suite, home: Path, until: str, env: dict[str, str] | None = None,
                 tag: str = "run", embedded: bool = False):
        self.home, self.log = home, self.log_of(home, tag)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        environment = cli_env(home, {**({} if embedded else bench.services), **(env or {})})
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *bench.overrides,
                 "--until", until], cwd=REPO, env=environment, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    @staticmethod
    def log_of(home: Path, tag: str) -> Path:
        return home.parent / f"{home.name}-{tag}.log"

    def tree(self) -> list[psutil.Process]:
        return process_tree(self.proc.pid)

    def wait(self, timeout: float = 1800) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _said(log: Path) -> str:
    """The one line `gristmill run` ends a failure with ("gristmill: ..."), or ""."""
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if line.startswith("gristmill: ")]
    return lines[-1] if lines else ""


def _tail(log: Path, lines: int = 6) -> str:
    """The last `lines` non-blank lines of a run's log, joined: why a run failed, in a trial's note."""
    return " / ".join([line.strip() for line in log.read_text(errors="replace").splitlines()
                       if line.strip()][-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate: Callable[[], bool], run: Run | None = None, timeout: float = 900) -> bool:
    """Poll until `predicate()`; False when `run` ended first or time ran out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if (run is not None and run.proc.poll() is not None) or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


class Suite:
    def __init__(self, overrides: list[str], work: Path, reference: Path | None, seed: int,
                 prefect_api_url: str | None = None):
        self.overrides, self.work, self.rng = overrides, work, random.Random(seed)
        self.seed = seed
        self.services = {"PREFECT_API_URL": prefect_api_url} if prefect_api_url else {}
        self.reference = reference or self._reference_run()
        self.seconds = {s: json.loads((committed_dir(self.reference, s) / "manifest.json")
                                      .read_text())["meta"].get("seconds", 10.0) for s in STAGES}

    # -- homes and comparisons ------------------------------------------------------------------
    def _reference_run(self) -> Path:
        home = self.work / "reference"
        run = Run(self, home, STAGES[-1], tag="reference")
        if run.wait() != 0:
            raise SystemExit(f"chaos: the reference run failed; see {run.log}")
        return home

    def home_for(self, name: str, stage: str) -> Path:
        """A fresh home holding the reference's committed stages upstream of `stage`."""
        home = self.work / name / "home"
        for upstream in STAGES[:STAGES.index(stage)]:
            src = committed_dir(self.reference, upstream)
            shutil.copytree(src, home / "artifacts" / upstream / src.name, copy_function=os.link)
        return home

    def same_as_reference(self, home: Path, stage: str) -> bool:
        try:
            return committed_files(home, stage) == committed_files(self.reference, stage)
        except StopIteration:
            return False

    def docs_lost(self, home: Path, stage: str) -> int:
        """Documents the reference kept that this home's collect output lacks (collect only)."""
        if stage != "collect":
            return 0
        def funnel(h: Path) -> dict:
            return json.loads((committed_dir(h, "collect") / "funnel.json").read_text())

        try:
            return max(0, _kept(funnel(self.reference)) - _kept(funnel(home)))
        except StopIteration:
            return _kept(funnel(self.reference))

    def finish(self, fault: str, stage: str, home: Path, note: str, ok: bool = True,
               tag: str = "rerun", env: dict[str, str] | None = None) -> Trial:
        """Run the same command again; the trial survives when it succeeds with the same output."""
        rerun = Run(self, home, stage, env=env, tag=tag)
        if rerun.wait() != 0:
            return Trial(fault=fault, stage=stage, survived=False, identical=False,
                         docs_lost=self.docs_lost(home, stage),
                         note=f"{note}; the re-run failed: {rerun.output()[-300:]!r}")
        same = self.same_as_reference(home, stage)
        return Trial(fault=fault, stage=stage, survived=ok and same, identical=same,
                     docs_lost=self.docs_lost(home, stage), note=note)


def _kept(funnel: dict) -> int:
    return int(funnel.get("accounting", {}).get("kept", funnel.get("kept_docs", 0)))
