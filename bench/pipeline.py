"""Pipeline benchmark: the tiny pipeline cold vs fully reused, and what the orchestration adds.

    python -m bench pipeline [--repeats 2] [--noop-stages 6] [overrides ...]

1. `cold_s`: `gristmill run configs/tiny.yaml` in a fresh GRISTMILL_HOME (new process each time);
   `reused_s`: the same command again over the finished store (every stage reused).
2. Per-stage overhead of Prefect task + MLflow child run + artifact store, on a stage that does
   nothing: inside one flow, N no-op stages computed (fresh keys) and then reused, against calling
   the no-op stage function directly.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _cli_seconds(home: Path, overrides: list[str]) -> float:
    env = {**os.environ, "GRISTMILL_HOME": str(home)}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", *overrides],
                   cwd=REPO, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def pipeline_times(repeats: int, overrides: list[str]) -> dict[str, list[float]]:
    cold, reused = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp) / "home"
            cold.append(_cli_seconds(home, overrides))
            reused.append(_cli_seconds(home, overrides))
    return {"cold": cold, "reused": reused}


def noop_overhead(n_stages: int) -> dict[str, float]:
    """Seconds per stage: direct call, through the flow computing, through the flow reusing."""
    from infra import env

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GRISTMILL_HOME"] = str(Path(tmp) / "home")
        env.configure()
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
    args = parser.parse_args(argv)
    times = pipeline_times(args.repeats, args.overrides)
    overhead = noop_overhead(args.noop_stages)
    cold, reused = statistics.median(times["cold"]), statistics.median(times["reused"])
    print(f"{'measure':<44}{'median':>10}   runs")
    print(f"{'tiny pipeline, cold (s)':<44}{cold:>10.1f}   {[round(t, 1) for t in times['cold']]}")
    print(f"{'tiny pipeline, fully reused (s)':<44}{reused:>10.1f}   {[round(t, 1) for t in times['reused']]}")
    print(f"{'no-op stage, direct call (ms)':<44}{overhead['direct_s'] * 1e3:>10.1f}")
    print(f"{'no-op stage via flow, computed (ms)':<44}{overhead['computed_s'] * 1e3:>10.1f}")
    print(f"{'no-op stage via flow, reused (ms)':<44}{overhead['reused_s'] * 1e3:>10.1f}")
    summary: dict[str, Any] = {
        "benchmark": "pipeline", "cold_s": round(cold, 2), "reused_s": round(reused, 2),
        "reuse_speedup": round(cold / reused, 2),
        "stage_overhead_computed_ms": round((overhead["computed_s"] - overhead["direct_s"]) * 1e3, 1),
        "stage_overhead_reused_ms": round((overhead["reused_s"] - overhead["direct_s"]) * 1e3, 1),
        "repeats": args.repeats,
    }
    print(json.dumps(summary))
    return 0
