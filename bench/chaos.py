"""Fault suite: `python -m bench chaos --trials N --seed S [--reference HOME] [key=value ...]`.

Each trial injects one fault into a run of the tiny preset (shortened as in the end-to-end tests;
overrides on the command line change it), lets the run fail or stop, runs the same command again,
and compares what the stage committed with an uninterrupted reference run, file by file (sha256;
step metrics aside, which carry tokens/s). A trial starts from a home holding the reference's
committed upstream stages (hard links), so it pays only for the stage under fault. Faults, in the
order trials cycle through them:

  kill9            the whole job (supervisor, pipeline, Prefect server, Ray) SIGKILLed at a seeded
                   moment of a stage; the j-th kill9 trial hits stage j (mod 6), so 6 cover all
  sigint           Ctrl-C to the terminal's process group: exit 130 within 10 s, nothing left running
  concurrent       two identical runs at once in a fresh home: both succeed, each stage once
  fuzz             25 damaged input sets through collect (tasks/collect/read/fuzz.py): no escape, books balance
  ray_worker       a Ray worker SIGKILLed mid-collect: the stage finishes by itself, same output
  commit           SIGKILL between a stage's manifest write and its rename (GRISTMILL_FAULT)
  disk_full        the stage's artifact folder on a small tmpfs: one clear error, then resume
  mlflow_down      the MLflow server killed mid-stage: the run fails with one clear line, the next
                   run (server back) reuses the stage and back-fills its metrics
  prefect_restart  the Prefect API server restarted mid-stage; the same command again if needed

With `--prefect-api-url URL` the runs use that standing Prefect server (`gristmill up`'s) instead of
each starting its own temporary one, which saves each run that start-up; the concurrent trial still
starts its own, as the race on creating its database is what it tests.

It prints a table (fault, trials, survived, identical, documents lost) and ends with one JSON line:
{"trials", "survived", "identical", "docs_lost"}. `identical` counts trials whose committed output
equals the reference's (fuzz trials have no reference and are not counted there).

`--load N` runs the load trial instead (bench/chaos_load.py): N runs started at once through the
Prefect API against one stack and one home, half with evaluate-only overrides; each key computed
once, every run Completed, each run's MLflow record and summary truthful about computed or reused.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from flows.runs import REPO, SHORT, STAGES, cli_env, committed_dir, committed_files
from infra.processes import alive, kill_all, process_tree

CYCLE = ["kill9", "sigint", "concurrent", "fuzz", "ray_worker", "kill9", "commit", "disk_full",
         "kill9", "mlflow_down", "kill9", "prefect_restart"]


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
                [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", *bench.overrides,
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


# -- the faults ------------------------------------------------------------------------------------

def _partial(home: Path, stage: str) -> Callable[[], bool]:
    return lambda: any((home / "artifacts" / stage).glob("*.partial"))


def kill9(suite: Suite, name: str, stage: str) -> Trial:
    home = suite.home_for(name, stage)
    run = Run(suite, home, stage)
    offset = suite.rng.uniform(0, 0.7 * suite.seconds[stage])
    if _wait_for(_partial(home, stage), run):
        time.sleep(offset)
    processes = run.tree() if run.proc.poll() is None else []
    kill_all(processes)
    note = f"SIGKILL {offset:.1f} s into {stage}" if processes else "finished before the kill"
    return suite.finish("kill9", stage, home, note)


def sigint(suite: Suite, name: str, stage: str) -> Trial:
    home = suite.home_for(name, stage)
    run = Run(suite, home, stage)
    offset = suite.rng.uniform(0, 0.7 * suite.seconds[stage])
    if not (_wait_for(_partial(home, stage), run) and (time.sleep(offset) or run.proc.poll() is None)):
        return suite.finish("sigint", stage, home, "finished before Ctrl-C")
    processes = run.tree()
    started = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    rc = run.wait(60)
    seconds = time.monotonic() - started
    time.sleep(1)
    left = alive(processes)
    kill_all(left)
    ok = rc == 130 and seconds < 10 and not left
    return suite.finish("sigint", stage, home, f"Ctrl-C {offset:.1f} s into {stage}: exit {rc} "
                        f"after {seconds:.1f} s, {len(left)} processes left", ok)


def fuzz(suite: Suite, name: str, stage: str) -> Trial:
    from tasks.collect.read.fuzz import run_fuzz

    logging.getLogger("gristmill").setLevel(logging.ERROR)  # each quarantined file says so
    result = run_fuzz(25, suite.rng.randrange(1 << 30), suite.work / name)
    return Trial(fault="fuzz", stage="collect", survived=result["survived"] == result["trials"],
                 identical=None, docs_lost=int(result["docs_lost"]),
                 note=f"{result['survived']}/{result['trials']} input sets")


def ray_worker(suite: Suite, name: str, stage: str) -> Trial:
    home = suite.home_for(name, "collect")
    run = Run(suite, home, "collect")

    def worker() -> psutil.Process | None:
        for proc in psutil.process_iter(["cmdline"]):
            is_worker = any("ray::_Worker" in part for part in proc.info["cmdline"] or [])
            if is_worker and proc.pid in {p.pid for p in run.tree()}:
                return proc
        return None

    found: list[psutil.Process] = []

    def seen() -> bool:
        if (proc := worker()) is not None:
            found.append(proc)
        return bool(found)

    _wait_for(seen, run)
    if found:
        time.sleep(suite.rng.uniform(0, 3))
        kill_all(found)
    rc = run.wait()
    same = rc == 0 and suite.same_as_reference(home, "collect")
    return Trial(fault="ray_worker", stage="collect", survived=same, identical=same,
                 docs_lost=suite.docs_lost(home, "collect"),
                 note=f"worker {found[0].pid} killed, run exit {rc}" if found else "no worker seen")


def commit(suite: Suite, name: str, stage: str) -> Trial:
    home = suite.home_for(name, stage)
    run = Run(suite, home, stage, env={"GRISTMILL_FAULT": f"commit:{stage}"})
    rc = run.wait()
    killed = rc == 128 + signal.SIGKILL and any((home / "artifacts" / stage).glob("*.partial/manifest.json"))
    trial = suite.finish("commit", stage, home, f"killed in {stage}'s commit window (exit {rc})",
                         ok=killed)
    finished = "finishing the commit" in Run.log_of(home, "rerun").read_text()
    return Trial(**{**trial.__dict__, "survived": trial.survived and finished})


def disk_full(suite: Suite, name: str, stage: str) -> Trial:
    home = suite.home_for(name, stage)
    folder = home / "artifacts" / stage
    folder.mkdir(parents=True, exist_ok=True)
    ref_bytes = sum(p.stat().st_size for p in committed_dir(suite.reference, stage).rglob("*"))
    size = max(1 << 20, ref_bytes // 2)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        return Trial(fault="disk_full", stage=stage, survived=False, identical=None, docs_lost=0,
                     note=f"not run: cannot mount a small filesystem ({mounted.stderr.strip()[:80]})")
    try:
        rc = Run(suite, home, stage).wait()
        said = _said(Run.log_of(home, "run"))
        clear = rc != 0 and "free disk space" in said
        subprocess.run(["mount", "-o", "remount,size=2g", str(folder)], check=True)
        return suite.finish("disk_full", stage, home, f"{size >> 10} KiB for {stage}: exit {rc}, "
                            f"said {said[:100]!r}", ok=clear)
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def concurrent(suite: Suite, name: str, stage: str) -> Trial:
    home = suite.home_for(name, "collect")  # a fresh home: the databases are created by the race
    runs = [Run(suite, home, "tokenize", tag=f"run{i}", embedded=True) for i in range(2)]
    codes = [r.wait() for r in runs]
    logs = "".join(r.output() for r in runs)
    once = all(logs.count(f"{s}: done in") == 1 for s in ("collect", "tokenize"))
    same = all(suite.same_as_reference(home, s) for s in ("collect", "tokenize"))
    failed = " | ".join(f"run{i}: {_tail(r.log)}" for i, (r, code) in enumerate(zip(runs, codes))
                        if code != 0)
    return Trial(fault="concurrent", stage="collect+tokenize", survived=codes == [0, 0] and once and same,
                 identical=same, docs_lost=suite.docs_lost(home, "collect"),
                 note=f"exits {codes}, each stage computed once: {once}" + (f"; {failed}" if failed else ""))


def _server(cmd: list[str], port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log.open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    def up() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    if not _wait_for(up, timeout=180):
        raise RuntimeError(f"{cmd[0]} did not start; see {log}")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    kill_all(process_tree(proc.pid))


def mlflow_down(suite: Suite, name: str, stage: str) -> Trial:
    home = suite.home_for(name, stage)
    port, store = _free_port(), home.parent / "mlflow-server"
    store.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{store}/mlflow.db", "--default-artifact-root",
           str(store / "artifacts"), "--workers", "1"]
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
    server = _server(cmd, port, {}, home.parent / "mlflow.log")
    run = Run(suite, home, stage, env=env)
    _wait_for(_partial(home, stage), run)
    time.sleep(suite.rng.uniform(0, 0.2 * suite.seconds[stage]))
    early = run.proc.poll() is not None
    _stop(server)
    rc = run.wait()
    said = _said(run.log)
    clear = rc == 0 or "MLflow at" in said
    server = _server(cmd, port, {}, home.parent / "mlflow.log")
    try:
        trial = suite.finish("mlflow_down", stage, home, f"exit {rc}, said {said[:100]!r}"
                             + (" (the run had ended before the server stopped)" if early else ""),
                             ok=clear, env=env)
        from infra.tracking.runs import stage_runs

        runs = stage_runs(env["MLFLOW_TRACKING_URI"], stage)
        logged = any(r.info.status == "FINISHED" and r.data.metrics for r in runs)
        return Trial(**{**trial.__dict__, "survived": trial.survived and logged,
                        "note": trial.note + f"; stage metrics in MLflow afterwards: {logged}"})
    finally:
        _stop(server)


def prefect_restart(suite: Suite, name: str, stage: str) -> Trial:
    home = suite.home_for(name, stage)
    port = _free_port()
    env = {"PREFECT_HOME": str(home.parent / "prefect-server"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = _server(cmd, port, env, home.parent / "prefect.log")
    run_env = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    run = Run(suite, home, stage, env=run_env)
    _wait_for(_partial(home, stage), run)
    time.sleep(suite.rng.uniform(0, 0.2 * suite.seconds[stage]))
    early = run.proc.poll() is not None
    _stop(server)
    server = _server(cmd, port, env, home.parent / "prefect.log")
    try:
        rc = run.wait()
        if rc == 0:
            same = suite.same_as_reference(home, stage)
            return Trial(fault="prefect_restart", stage=stage, survived=same, identical=same,
                         docs_lost=suite.docs_lost(home, stage),
                         note="the run had ended before the restart" if early
                         else "the run rode out the restart")
        return suite.finish("prefect_restart", stage, home, f"the run failed (exit {rc}); re-run",
                            env=run_env)
    finally:
        _stop(server)


FAULTS: dict[str, Callable[[Suite, str, str], Trial]] = {
    "kill9": kill9, "sigint": sigint, "fuzz": fuzz, "ray_worker": ray_worker, "commit": commit,
    "disk_full": disk_full, "concurrent": concurrent, "mlflow_down": mlflow_down,
    "prefect_restart": prefect_restart}
ANY_STAGE = {"commit": STAGES, "sigint": STAGES, "disk_full": ["collect", "tokenize", "pretrain"],
             "mlflow_down": ["tokenize", "pretrain", "sft"], "prefect_restart": ["pretrain", "sft"]}


def schedule(trials: int, seed: int) -> list[tuple[str, str]]:
    """(fault, stage) of each trial: faults cycle through CYCLE; kill9 walks the stages."""
    rng, plan, kills = random.Random(seed), [], 0
    for i in range(trials):
        fault = CYCLE[i % len(CYCLE)]
        if fault == "kill9":
            stage, kills = STAGES[(seed + kills) % len(STAGES)], kills + 1
        else:
            stage = rng.choice(ANY_STAGE.get(fault, ["collect"]))
        plan.append((fault, stage))
    return plan


def report(results: list[Trial]) -> dict[str, int]:
    print(f"\n{'fault':<16} {'trials':>6} {'survived':>8} {'identical':>9} {'docs lost':>9}")
    for fault in dict.fromkeys(t.fault for t in results):
        rows = [t for t in results if t.fault == fault]
        compared = [t for t in rows if t.identical is not None]
        print(f"{fault:<16} {len(rows):>6} {sum(t.survived for t in rows):>8} "
              f"{sum(bool(t.identical) for t in compared):>5}/{len(compared):<3} "
              f"{sum(t.docs_lost for t in rows):>9}")
    return {"trials": len(results), "survived": sum(t.survived for t in results),
            "identical": sum(bool(t.identical) for t in results),
            "docs_lost": sum(t.docs_lost for t in results)}


def _load(runs: int, overrides: list[str], work: Path) -> int:
    from bench.chaos_load import report as report_load
    from bench.chaos_load import run_load

    figures = report_load(run_load(runs, overrides, work))
    print(json.dumps(figures))
    whole = figures["finished"] == runs and figures["computed_once"] == figures["keys"] and \
        figures["truthful_records"] == figures["records"] == runs * len(STAGES)
    return 0 if whole else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", type=Path, help="GRISTMILL_HOME of a finished run of the "
                        "same config (default: run one first)")
    parser.add_argument("--work", type=Path, help="where trial homes go (default: a temp dir)")
    parser.add_argument("--prefect-api-url", help="a standing Prefect server for the runs "
                        "(default: each starts its own)")
    parser.add_argument("--load", type=int, metavar="N", help="the load trial: N runs at once through "
                        "the Prefect API (bench/chaos_load.py) instead of the fault trials")
    parser.add_argument("overrides", nargs="*", help=f"config overrides (default: {' '.join(SHORT)})")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="gristmill-chaos-"))
    if args.load:
        return _load(args.load, args.overrides or SHORT, work)
    suite = Suite(args.overrides or SHORT, work, args.reference, args.seed, args.prefect_api_url)
    results = []
    for i, (fault, stage) in enumerate(schedule(args.trials, args.seed)):
        started = time.monotonic()
        trial = FAULTS[fault](suite, f"t{i:02d}-{fault}", stage)
        results.append(trial)
        print(f"trial {i:>2} {fault:<16} {trial.stage:<16} survived={trial.survived} "
              f"identical={trial.identical} docs_lost={trial.docs_lost} "
              f"({time.monotonic() - started:.0f} s) {trial.note}", flush=True)
    print(json.dumps(report(results)))
    return 0
