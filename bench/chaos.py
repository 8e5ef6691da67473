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
import random
import tempfile
import time
from pathlib import Path

from bench.chaos_faults import ANY_STAGE, FAULTS
from bench.chaos_suite import Suite, Trial
from gristmill.flows.runs import SHORT, STAGES

# The trials' runs and homes are in bench/chaos_suite.py, the faults in bench/chaos_faults.py; this
# module plans the trials, runs them and reports (its docstring is --help's text).

CYCLE = ["kill9", "sigint", "concurrent", "fuzz", "ray_worker", "kill9", "commit", "disk_full",
         "kill9", "mlflow_down", "kill9", "prefect_restart"]


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
