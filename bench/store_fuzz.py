"""Store fuzzing: random damage to a copy of a finished run's artifact store, each one found.

    python -m bench store-fuzz [--trials 240] [--seed 0] [--home HOME] [--runs K] [--smoke] [key=value ...]

The store is a copy of HOME's artifacts (a finished `gristmill run configs/tiny.yaml` with the
overrides given, which the bench makes first, shortened as the end-to-end tests are, when no
--home is given). Trial i applies damage of kind KINDS[i mod 13], at a place drawn from
`random.Random(f"{seed}:{i}")`, to one committed output or to the store's folders:

  delete_file      a listed file removed            delete_manifest  manifest.json removed
  delete_folder    a folder of an output removed    truncate         a file cut short (manifest too)
  flip_bit         one bit of a file flipped        edit_field       a manifest field changed
  empty_field      a manifest field emptied or removed (the manifest rewritten as a tool would)
  add_file         a file added inside an output    add_folder       an empty folder added there
  add_entry        a file or folder added beside the outputs or at the top, or a copy of an
                   output under another key
  rename_file      a listed file renamed            rename_folder    a folder of an output, the
                                                                     output, or its stage's renamed
  unreadable       a file made unreadable: mode 000 (which root still reads: the check reads the
                   mode bits), or a folder, a FIFO or a dangling symlink in its place

Each trial checks, on the store itself, that `ArtifactStore.survey` (what `gristmill verify`
prints) names the damage (the entry, and the file in it), that reuse refuses every output the
damage touched (`load` returns None) with `verify_on_reuse` "sha256" and with the default "size"
(except a same-size change of a file over SMALL_FILE_BYTES, which only hashing sees: by design),
and that nothing else is reported (no output it did not touch is named or refused). Then the
store is restored from the source. With `--runs K`, the first K trials also copy the damaged store
into a fresh home and run the pipeline there: it must end with every stage's files the bytes of
the undamaged store (step metrics aside, which carry tokens/s).

An output deleted whole is not among the kinds: nothing is left to name, and a run computes it.
`--smoke`: one trial of each kind and one run, over a home of the preset shrunk to seconds a stage
(bench/smoke.py RUN) when no --home is given.

It prints a table per kind and ends with one JSON line: {"trials", "detected", "undetected",
"reused_by_size", "seconds", "runs", "identical"}. The trials are bench/harness/store_fuzz.py's, which
tests/infra/test_store_fuzz.py runs in CI.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import smoke
from bench.harness.runs import REPO, SHORT, STAGES, cli_env, committed_dir, manifest_files
from bench.harness.store_damage import KINDS
from bench.harness.store_fuzz import Trial, run_trials


def _copy_home(root: Path, home: Path) -> None:
    """The damaged store `root` as the artifacts of a fresh `home` (a FIFO made anew, not read)."""
    def copy(src: str, dst: str) -> None:
        if stat.S_ISFIFO(os.lstat(src).st_mode):
            os.mkfifo(dst)
        else:
            shutil.copy2(src, dst)
    shutil.copytree(root, home / "artifacts", symlinks=True, copy_function=copy)


def pipeline_check(source_home: Path, overrides: list[str], work: Path,
                   runs: int) -> Callable[[int, Path], bool | None]:
    """`after` for run_trials: the first `runs` trials run the pipeline over their damaged store;
    each stage's output under the source's key must then hold the source's bytes."""
    def after(i: int, root: Path) -> bool | None:
        if i >= runs:
            return None
        home = work / f"run-{i}"
        _copy_home(root, home)
        done = _gristmill(home, overrides)
        same = done.returncode == 0 and all(
            (home / "artifacts" / stage / source.name).is_dir()
            and manifest_files(home / "artifacts" / stage / source.name) == manifest_files(source)
            for stage, source in _outputs(source_home).items())
        if not same:
            print(f"store-fuzz: trial {i}: the run over the damaged store ended differently:\n"
                  f"{(done.stdout + done.stderr)[-3000:]}", file=sys.stderr)
        shutil.rmtree(home, ignore_errors=True)
        return same
    return after


def _outputs(home: Path) -> dict[str, Path]:
    """stage -> the committed output of each stage in `home` (one each: a finished run's)."""
    return {stage: committed_dir(home, stage) for stage in STAGES}


def _gristmill(home: Path, overrides: list[str], *more: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *overrides, *more],
                          cwd=REPO, env=cli_env(home), capture_output=True, text=True)


def _reused_whole(home: Path, overrides: list[str]) -> None:
    """SystemExit unless this checkout, with `overrides`, plans to reuse every stage of `home` (else
    a run over a damaged copy would recompute for another reason than the damage)."""
    planned = _gristmill(home, overrides, "--dry-run").stdout.split("# plan", 1)[-1].splitlines()[1:]
    if running := [row.split()[0] for row in planned if row.strip() and row.split()[-1] != "reuse"]:
        raise SystemExit(f"store-fuzz: {home} is not this checkout's run of configs/tiny.yaml {' '.join(overrides)}:"
                         f" {', '.join(running)} would compute; give its overrides, or leave out --home")


def table(results: list[Trial]) -> str:
    rows = [f"{'kind':<16}{'trials':>7}{'named':>7}{'refused':>9}{'by size':>9}{'detected':>10}{'undetected':>12}"]
    for kind in [*KINDS, "all"]:
        mine = [t for t in results if kind in ("all", t.kind)]
        rows.append(f"{kind:<16}{len(mine):>7}{sum(t.named for t in mine):>7}{sum(t.refused_sha256 for t in mine):>9}"
                    f"{sum(t.refused_size for t in mine):>9}{sum(t.detected for t in mine):>10}"
                    f"{sum(not t.detected for t in mine):>12}")
    return "\n".join(rows)


def _reference(work: Path, overrides: list[str]) -> Path:
    home = work / "reference"
    if (done := _gristmill(home, overrides)).returncode != 0:
        raise SystemExit(f"store-fuzz: the reference run failed:\n{done.stderr[-4000:]}")
    return home


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench store-fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--home", type=Path, help="a finished run's GRISTMILL_HOME (its overrides after the options)")
    parser.add_argument("--runs", type=int, default=0, help="run the pipeline over the first K damaged stores")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = smoke.parse(parser, argv, trials=len(KINDS), runs=1)
    logging.getLogger("gristmill.store").setLevel(logging.ERROR)  # each refusal's warning: the table says it
    overrides = args.overrides if args.home else [*(smoke.RUN if args.smoke else SHORT), *args.overrides]
    with tempfile.TemporaryDirectory(prefix="store-fuzz-") as tmp:
        work = Path(tmp)
        home = args.home.resolve() if args.home else _reference(work, overrides)
        if args.runs:
            _reused_whole(home, overrides)
        after = pipeline_check(home, overrides, work, args.runs) if args.runs else None
        start = time.perf_counter()
        results = run_trials(home / "artifacts", work, args.trials, args.seed, after)
        seconds = time.perf_counter() - start
    print(table(results))
    for trial in results:
        if trial.detected and not trial.refused_size:
            print(f"  reused by size, by design (a same-size change of a file over 1 MiB): {trial.what}")
        if not trial.detected or trial.identical is False:
            print(f"  {trial.kind}: {trial.what}: named={trial.named} refused={trial.refused_sha256}/"
                  f"{trial.refused_size} spurious={trial.spurious} identical={trial.identical}")
    ran = [t for t in results if t.identical is not None]
    print(json.dumps({"trials": len(results), "detected": sum(t.detected for t in results),
                      "undetected": sum(not t.detected for t in results),
                      "reused_by_size": sum(not t.refused_size for t in results), "seconds": round(seconds, 1),
                      "runs": len(ran), "identical": sum(bool(t.identical) for t in ran)}))
    return 0 if all(t.detected for t in results) and all(t.identical for t in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
