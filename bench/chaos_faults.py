"""The fault suite's faults (bench/chaos.py's docstring lists them): one function per fault, each
injecting it into a run in a trial's home and judging how the run and its re-run came through;
`FAULTS` names them and `ANY_STAGE` says which stages each may hit.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from bench.chaos_suite import Run, Suite, Trial, _free_port, _said, _tail, _wait_for
from bench.harness.runs import STAGES, committed_dir
from gristmill.infra.processes import alive, kill_all, process_tree

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
    from bench.harness.fuzz import run_fuzz

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
        from gristmill.infra.tracking.runs import stage_runs

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
