"""Fault suite: `python -m bench chaos --trials N --seed S [--reference HOME] [key=value ...]`.

Each trial injects one fault into a run of the tiny preset (shortened as in the end-to-end tests;
overrides on the command line change it), lets the run fail or stop, runs the same command again,
and compares what the stage committed with an uninterrupted reference run, file by file (sha256;
step metrics aside, which carry tokens/s). A trial starts from a home holding the reference's
committed upstream stages (hard links), so it pays only for the stage under fault. The first nine
trials draw each kind of fault once, in this order; later trials cycle through them again, with three
more kill9 trials each round (`--trials 9` or more draws every kind; with fewer, the kinds left out
are named in the plan, the report and its JSON line; `--dry-run` prints the plan and stops):

  kill9            the whole job (supervisor, pipeline, Prefect server, Ray) SIGKILLed at a seeded
                   moment of a stage; the j-th kill9 trial hits stage j (mod 6), so 6 cover all
  sigint           Ctrl-C to the terminal's process group: exit 130 within 10 s, nothing left running
  concurrent       two identical runs at once in a fresh home: both succeed, each stage once
  fuzz             25 damaged input sets through collect (bench/harness/fuzz.py): no escape, books balance
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
{"trials", "survived", "identical", "docs_lost", "left_out"}. `identical` counts trials whose committed output
equals the reference's (fuzz trials have no reference and are not counted there).

`--smoke` runs three cheap trials instead of the schedule (SMOKE: a kill9 and a commit fault in the
last stage, and the fuzz trial), the runs shrunk to seconds a stage (bench/smoke.py RUN) unless
overrides are given: every step of a trial and the report, not every kind.

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

from bench import smoke
from bench.chaos_faults import ANY_STAGE, FAULTS
from bench.chaos_suite import Suite, Trial
from bench.harness.runs import SHORT, STAGES

# The trials' runs and homes are in bench/chaos_suite.py, the faults in bench/chaos_faults.py; this
# module plans the trials, runs them and reports (its docstring is --help's text).

KINDS = ["kill9", "sigint", "concurrent", "fuzz", "ray_worker", "commit", "disk_full", "mlflow_down",
         "prefect_restart"]
CYCLE = [*KINDS, "kill9", "kill9", "kill9"]  # every kind before any repeats; kill9 walks the 6 stages
SMOKE = [("kill9", STAGES[-1]), ("commit", STAGES[-1]), ("fuzz", "collect")]  # --smoke's trials: the cheapest


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


def left_out(plan: list[tuple[str, str]]) -> list[str]:
    """The kinds of fault a plan of trials never draws."""
    return [kind for kind in KINDS if kind not in {fault for fault, _ in plan}]


def report(results: list[Trial], missing: list[str]) -> dict[str, object]:
    print(f"\n{'fault':<16} {'trials':>6} {'survived':>8} {'identical':>9} {'docs lost':>9}")
    for fault in dict.fromkeys(t.fault for t in results):
        rows = [t for t in results if t.fault == fault]
        compared = [t for t in rows if t.identical is not None]
        print(f"{fault:<16} {len(rows):>6} {sum(t.survived for t in rows):>8} "
              f"{sum(bool(t.identical) for t in compared):>5}/{len(compared):<3} "
              f"{sum(t.docs_lost for t in rows):>9}")
    if missing:
        print(f"not drawn with {len(results)} trials: {', '.join(missing)} (--trials {len(KINDS)} draws every kind)")
    return {"trials": len(results), "survived": sum(t.survived for t in results),
            "identical": sum(bool(t.identical) for t in results),
            "docs_lost": sum(t.docs_lost for t in results), "left_out": missing}


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
    parser.add_argument("--trials", type=int, default=20, help=f"trials; {len(KINDS)} or more draw every "
                        "kind of fault, fewer leave the last kinds of the list above out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", type=Path, help="GRISTMILL_HOME of a finished run of the "
                        "same config (default: run one first)")
    parser.add_argument("--work", type=Path, help="where trial homes go (default: a temp dir)")
    parser.add_argument("--prefect-api-url", help="a standing Prefect server for the runs "
                        "(default: each starts its own)")
    parser.add_argument("--load", type=int, metavar="N", help="the load trial: N runs at once through "
                        "the Prefect API (bench/chaos_load.py) instead of the fault trials")
    parser.add_argument("--dry-run", action="store_true", help="print the plan of trials (fault, stage) "
                        "and the kinds it leaves out, as one JSON line, and run nothing")
    parser.add_argument("overrides", nargs="*", help=f"config overrides (default: {' '.join(SHORT)})")
    args = smoke.parse(parser, argv, note="the trials " + ", ".join(f"{fault} ({stage})" for fault, stage in SMOKE)
                       + " instead of --trials; the runs' overrides bench/smoke.py RUN")
    plan = SMOKE if args.smoke else schedule(args.trials, args.seed)
    defaults = smoke.RUN if args.smoke else SHORT
    if missing := left_out(plan):
        print(f"{len(plan)} trials leave out: {', '.join(missing)}", flush=True)
    if args.dry_run:
        print(json.dumps({"trials": [list(trial) for trial in plan], "left_out": missing}))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="gristmill-chaos-"))
    if args.load:
        return _load(args.load, args.overrides or defaults, work)
    suite = Suite(args.overrides or defaults, work, args.reference, args.seed, args.prefect_api_url)
    results = []
    for i, (fault, stage) in enumerate(plan):
        started = time.monotonic()
        trial = FAULTS[fault](suite, f"t{i:02d}-{fault}", stage)
        results.append(trial)
        print(f"trial {i:>2} {fault:<16} {trial.stage:<16} survived={trial.survived} "
              f"identical={trial.identical} docs_lost={trial.docs_lost} "
              f"({time.monotonic() - started:.0f} s) {trial.note}", flush=True)
    print(json.dumps(report(results, missing)))
    return 0
