"""Pipeline benchmark: the tiny pipeline cold vs fully reused, and what the orchestration adds.

    python -m bench pipeline [--repeats 2] [--noop-stages 6] [--smoke] [overrides ...]

1. `cold_s`: `gristmill run configs/tiny.yaml` in a fresh GRISTMILL_HOME (new process each time);
   `reused_s`: the same command again over the finished store (every stage reused), with the
   embedded Prefect API and MLflow store; `reused_s_with_server`: the same against a standing
   stack (`gristmill up`: Prefect server, MLflow server, Ray head; one warm-up run first, as a
   user with the stack up has made runs before); `dry_run_s`: `--dry-run` over the finished store.
2. `new_home_services_s`: the embedded services (Prefect's API server, MLflow's store) starting
   in a new home whose databases are copied from migrated templates (infra/schemas.py; built
   before the first repeat), against `new_home_services_unseeded_s`: the same with
   GRISTMILL_SCHEMA_TEMPLATES=0, where the servers migrate new databases; the two alternate.
   `cold_s` above is a machine's first run: each cold run has a cache of its own, so it builds
   the templates too.
3. Per-stage overhead of Prefect task + MLflow child run + artifact store, on a stage that does
   nothing: inside one flow, N no-op stages computed (fresh keys) and then reused, against calling
   the no-op stage function directly.

`--smoke`: one repeat of each, two no-op stages, the preset shrunk to seconds a stage (bench/smoke.py
RUN) unless overrides are given.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import smoke

REPO = Path(__file__).resolve().parents[1]


def _cli_seconds(home: Path, args: list[str], exports: dict[str, str] | None = None) -> float:
    env = {**os.environ, "GRISTMILL_HOME": str(home), "GRISTMILL_CACHE": str(home / "cache"),
           **(exports or {})}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *args],
                   cwd=REPO, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def _with_server(home: Path, args: list[str], repeats: int) -> list[float]:
    """Fully reused runs against a standing stack in `home` (on free ports), after a warm-up."""
    from gristmill.infra import stack

    states = stack.up(home, ports=stack.Ports.free())
    try:
        if any(s.state != "running" for s in states):
            raise RuntimeError(f"the stack did not come up:\n{stack.format_states(states)}")
        exports = {k: v for s in states for k, v in s.export.items()}
        _cli_seconds(home, args, exports)
        return [_cli_seconds(home, args, exports) for _ in range(repeats)]
    finally:
        stack.down(home)


def pipeline_times(repeats: int, overrides: list[str]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"cold": [], "reused": [], "dry_run": []}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        for _ in range(repeats):
            shutil.rmtree(home, ignore_errors=True)
            times["cold"].append(_cli_seconds(home, overrides))
            times["reused"].append(_cli_seconds(home, overrides))
            times["dry_run"].append(_cli_seconds(home, [*overrides, "--dry-run"]))
        times["reused_with_server"] = _with_server(home, overrides, repeats)
    return times


SERVICES_START = """
import json, sys, time
import gristmill.flows.entry  # configures the process
from gristmill.infra import env
started = time.perf_counter()
from gristmill.infra.services import start_embedded_services
start_embedded_services(env.gristmill_home())
print(json.dumps(time.perf_counter() - started))
"""


def new_home_services(repeats: int) -> dict[str, list[float]]:
    """Seconds to start the embedded services in a new home, seeded and not, alternating."""
    times: dict[str, list[float]] = {"new_home_services": [], "new_home_services_unseeded": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats + 1):  # the first, unrecorded, builds the templates
            for name, templates in (("new_home_services", "1"), ("new_home_services_unseeded", "0")):
                if not repeat and templates == "0":
                    continue  # builds nothing
                home = Path(tmp) / f"home-{repeat}-{templates}"
                env = {**os.environ, "GRISTMILL_HOME": str(home), "GRISTMILL_CACHE": str(Path(tmp) / "cache"),
                       "GRISTMILL_SCHEMA_TEMPLATES": templates}
                env.pop("PREFECT_API_URL", None), env.pop("MLFLOW_TRACKING_URI", None)
                out = subprocess.run([sys.executable, "-c", SERVICES_START], cwd=REPO, env=env, check=True,
                                     capture_output=True, text=True).stdout
                if repeat:
                    times[name].append(json.loads(out.strip().splitlines()[-1]))
    return times


def noop_overhead(n_stages: int) -> dict[str, float]:
    """Seconds per stage: direct call, through the flow computing, through the flow reusing."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GRISTMILL_HOME"] = str(Path(tmp) / "home")
        import gristmill.flows.entry  # noqa: F401  configures this process for that home, before Prefect
        from bench import noop_flow

        direct = noop_flow.direct_seconds(n_stages)
        computed = noop_flow.noop_flow(n_stages) / n_stages
        reused = noop_flow.noop_flow(n_stages) / n_stages
    return {"direct_s": direct / n_stages, "computed_s": computed, "reused_s": reused}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench pipeline")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--noop-stages", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = smoke.parse(parser, argv, repeats=1, noop_stages=2, overrides=smoke.RUN)
    times = pipeline_times(args.repeats, args.overrides) | new_home_services(args.repeats)
    overhead = noop_overhead(args.noop_stages)
    median = {name: statistics.median(runs) for name, runs in times.items()}
    cold, reused = median["cold"], median["reused"]
    print(f"{'measure':<44}{'median':>10}   runs")
    for name, label in (("cold", "tiny pipeline, cold (s)"), ("reused", "tiny pipeline, fully reused (s)"),
                        ("reused_with_server", "same, against `gristmill up` (s)"),
                        ("dry_run", "--dry-run over the finished store (s)"),
                        ("new_home_services", "services start, new home, templates (s)"),
                        ("new_home_services_unseeded", "same, servers migrate (s)")):
        print(f"{label:<44}{median[name]:>10.1f}   {[round(t, 1) for t in times[name]]}")
    print(f"{'no-op stage, direct call (ms)':<44}{overhead['direct_s'] * 1e3:>10.1f}")
    print(f"{'no-op stage via flow, computed (ms)':<44}{overhead['computed_s'] * 1e3:>10.1f}")
    print(f"{'no-op stage via flow, reused (ms)':<44}{overhead['reused_s'] * 1e3:>10.1f}")
    summary: dict[str, Any] = {
        "benchmark": "pipeline", "cold_s": round(cold, 2), "reused_s": round(reused, 2),
        "reuse_speedup": round(cold / reused, 2),
        "reused_s_with_server": round(median["reused_with_server"], 2),
        "dry_run_s": round(median["dry_run"], 2),
        "new_home_services_s": round(median["new_home_services"], 2),
        "new_home_services_unseeded_s": round(median["new_home_services_unseeded"], 2),
        "stage_overhead_computed_ms": round((overhead["computed_s"] - overhead["direct_s"]) * 1e3, 1),
        "stage_overhead_reused_ms": round((overhead["reused_s"] - overhead["direct_s"]) * 1e3, 1),
        "repeats": args.repeats,
    }
    print(json.dumps(summary))
    return 0
