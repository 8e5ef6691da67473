"""Start-up benchmark: `gristmill run` from several checkouts, side by side, to see what a change to
the start-up saves.

    python -m bench startup [--rounds 5] [--cold-rounds 3] [--against REV] [--variant NAME=CHECKOUT ...]
                            [--home HOME] [--smoke] [overrides ...]

Each variant is a checkout of this repository (a folder: `--variant NAME=PATH`; or a commit:
`--against REV`, checked out into a temporary git worktree), run with this interpreter and its
venv. The first variant, the reference, is this checkout (`--variant this=PATH` names another).
Two measures, the variants interleaved in every round (a different one first each round), so a
noisy shared machine weighs on all alike:

- `reused`: the tiny preset shortened as the end-to-end tests run it (bench/harness/runs.py `SHORT`; the
  overrides given instead, if any), fully reused over one finished GRISTMILL_HOME (made first, by
  this checkout; or `--home`, a finished run of those overrides, which the runs then add to),
  embedded services;
- `cold`: `--until collect` in a fresh home (the schema templates built beforehand, as on any
  machine after its first run): a cold run's start-up and its first Ray stage, which is all a
  start-up change can touch of a cold run (later stages start no Ray and import nothing new).

Per variant: median seconds, and per round its difference from (and ratio to) the reference's run
of the same round (negative, below 1: faster than the reference), with their medians.

`--smoke`: one round of each measure, the preset shrunk to seconds a stage (bench/smoke.py RUN)
unless overrides are given.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench import smoke
from bench.harness.runs import REPO, SHORT


def _seconds(checkout: Path, home: Path, cache: Path, args: list[str]) -> float:
    """Wall seconds of `python -m gristmill run configs/tiny.yaml ARGS` run from `checkout`."""
    environ = {**os.environ, "GRISTMILL_HOME": str(home), "GRISTMILL_CACHE": str(cache)}
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", "PREFECT_HOME"):
        environ.pop(name, None)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *args],
                          cwd=checkout, env=environ, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"run from {checkout} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


@contextlib.contextmanager
def _worktree(rev: str) -> Iterator[Path]:
    """`rev` checked out into a temporary git worktree of this repository."""
    folder = Path(tempfile.mkdtemp(prefix="gristmill-startup-")) / "checkout"
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), rev], cwd=REPO, check=True,
                   capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO, capture_output=True)
        shutil.rmtree(folder.parent, ignore_errors=True)


def interleaved(variants: dict[str, Path], rounds: int, run) -> dict[str, list[float]]:
    """`run(name, checkout, round)` for every variant in every round, a different variant first in
    each round; name -> seconds per round."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            times[name].append(run(name, variants[name], round_))
    return times


def measure(variants: dict[str, Path], rounds: int, cold_rounds: int, overrides: list[str] = SHORT,
            finished: Path | None = None) -> dict[str, dict[str, list[float]]]:
    reference = next(iter(variants.values()))
    measures = {}
    with tempfile.TemporaryDirectory(prefix="gristmill-startup-") as tmp:
        work = Path(tmp)
        cache, home = work / "cache", finished or work / "reused"
        if rounds:
            if finished is None:
                _seconds(reference, home, cache, overrides)  # the finished home every reused run reuses
            for checkout in variants.values():  # untimed: a checkout's first run over a home is slower
                _seconds(checkout, home, cache, overrides)
            measures["reused"] = interleaved(variants, rounds,
                                             lambda name, checkout, _: _seconds(checkout, home, cache, overrides))

        def cold(name: str, checkout: Path, round_: int) -> float:
            fresh = work / f"cold-{name}-{round_}"
            try:
                return _seconds(checkout, fresh, cache, [*overrides, "--until", "collect"])
            finally:
                shutil.rmtree(fresh, ignore_errors=True)

        if cold_rounds:
            if not rounds:  # the schema templates, as a machine's first run leaves them
                cold("warm-up", reference, 0)
            measures["cold"] = interleaved(variants, cold_rounds, cold)
    return measures


def table(measures: dict[str, dict[str, list[float]]]) -> list[dict]:
    """One row per measure and variant: runs, median, per-round difference from the reference."""
    rows = []
    for measure_name, times in measures.items():
        reference = next(iter(times), None)
        for name, runs in times.items():
            deltas = [run - ref for run, ref in zip(runs, times[reference], strict=True)]
            ratios = [run / ref for run, ref in zip(runs, times[reference], strict=True)]
            rows.append({"measure": measure_name, "variant": name, "median_s": round(statistics.median(runs), 2),
                         "runs": [round(t, 2) for t in runs], "delta_s": [round(d, 2) for d in deltas],
                         "median_delta_s": round(statistics.median(deltas), 2),
                         "median_ratio": round(statistics.median(ratios), 3)})
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench startup")
    parser.add_argument("--rounds", type=int, default=5, help="fully reused runs per variant")
    parser.add_argument("--cold-rounds", type=int, default=3, help="cold runs (--until collect) per variant")
    parser.add_argument("--against", action="append", default=[], metavar="REV",
                        help="a commit to compare with, checked out into a temporary worktree")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=CHECKOUT",
                        help="a checkout folder to compare with")
    parser.add_argument("--home", type=Path, help="a finished run of the overrides, for the reused runs "
                        "(default: one made first)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=f"the runs' (default: {' '.join(SHORT)})")
    args = smoke.parse(parser, argv, rounds=1, cold_rounds=1, overrides=smoke.RUN)
    with contextlib.ExitStack() as stack:
        variants = {"this": REPO}
        for item in args.variant:
            name, _, path = item.partition("=")
            variants[name] = Path(path).resolve()
        for rev in args.against:
            variants[rev] = stack.enter_context(_worktree(rev))
        rows = table(measure(variants, args.rounds, args.cold_rounds, args.overrides or SHORT, args.home))
    print(f"{'measure':<8}{'variant':<20}{'median s':>9}{'median Δ s':>11}{'median ratio':>13}   runs / Δ per round")
    for row in rows:
        print(f"{row['measure']:<8}{row['variant']:<20}{row['median_s']:>9.2f}{row['median_delta_s']:>+11.2f}"
              f"{row['median_ratio']:>13.3f}   {row['runs']} / {row['delta_s']}")
    print(json.dumps({"benchmark": "startup", "rows": rows}))
    return 0
