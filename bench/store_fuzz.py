"""Store fuzzing: random damage to a copy of a finished run's artifact store, each one found.

    python -m bench store-fuzz [--trials 240] [--seed 0] [--home HOME] [--runs K] [key=value ...]

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
It prints a table per kind and ends with one JSON line: {"trials", "detected", "undetected",
"reused_by_size", "seconds", "runs", "identical"}. tests/test_store_fuzz.py runs it in CI.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.runs import REPO, SHORT, STAGES, cli_env, committed_dir, manifest_files
from bench.store_damage import KINDS, Harm, Output
from flows.stages import contracts
from infra.artifacts import ArtifactStore, Entry
from infra.integrity import VerifyMode, read_manifest


@dataclass
class Trial:
    """One trial's damage and what the checks made of it."""
    kind: str
    what: str
    named: bool
    refused_sha256: bool
    refused_size: bool
    unhashed: bool
    spurious: list[str] = field(default_factory=list)
    identical: bool | None = None  # None: no run after it

    @property
    def detected(self) -> bool:
        """Named by verify, refused for reuse (by size too, unless only hashing can see it), and
        nothing else named or refused."""
        return self.named and self.refused_sha256 and (self.refused_size or self.unhashed) and not self.spurious


# --- trials -------------------------------------------------------------------------------------

def outputs_of(store: ArtifactStore) -> list[Output]:
    """The committed outputs of a store that verifies (SystemExit naming what does not)."""
    if bad := [f"{entry.path}: {entry.problems or entry.kind}" for entry in store.survey()
               if entry.kind == "unknown" or entry.problems]:
        raise SystemExit("store-fuzz: the source store does not verify:\n  " + "\n  ".join(bad))
    return [Output(found, read_manifest(found[2])[0]["files"]) for found in store.committed()]


def check(store: ArtifactStore, harm: Harm, outputs: list[Output]) -> tuple[bool, bool, bool, list[str]]:
    """(verify named it, reuse refused it by sha256, by size, what else was reported or refused);
    an exception, in verify or in reuse, counts as a miss."""
    try:
        findings = {entry.path: entry for entry in store.survey() if entry.kind == "unknown" or entry.problems}
    except Exception as error:  # a crash is what the fuzzer is for
        return False, _refused(store, harm, "sha256"), _refused(store, harm, "size"), [f"verify raised {error!r}"]
    named = all(path in findings and (rel is None or rel in findings[path].problems) for path, rel in harm.named)
    spurious = [f"{path.relative_to(store.root)}: {_said(entry)}" for path, entry in findings.items()
                if path not in {named_path for named_path, _ in harm.named}]
    reuse = ArtifactStore(store.root, "size", contracts=store.contracts)
    spurious += [f"{out.stage}-{out.key} refused" for out in outputs  # those it left alone (or moved whole)
                 if (out.stage, out.key) not in harm.refused and out.path.exists()
                 and reuse.load(out.stage, out.key) is None]
    return named, _refused(store, harm, "sha256"), _refused(store, harm, "size"), spurious


def _refused(store: ArtifactStore, harm: Harm, mode: VerifyMode) -> bool:
    """Whether reuse with `verify_on_reuse=mode` refuses every output the damage touched."""
    reuse = ArtifactStore(store.root, mode, contracts=store.contracts)
    try:
        return all(reuse.load(stage, key) is None for stage, key in harm.refused)
    except Exception:  # reuse must refuse, not crash
        return False


def _said(entry: Entry) -> str:
    return ", ".join(f"{rel} ({why})" for rel, why in entry.problems.items()) or entry.kind


def restore(root: Path, source: Path, names: set[str]) -> None:
    """Put the top-level entries `names` of the store at `root` back as they are in `source`."""
    for name in names:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            for folder, dirs, files in os.walk(path):  # a folder or file damaged to mode 000
                for entry in [*dirs, *files]:
                    if not (Path(folder) / entry).is_symlink():
                        (Path(folder) / entry).chmod(0o755)
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        if (source / name).exists():
            shutil.copytree(source / name, path, symlinks=True)


def run_trials(source: Path, work: Path, trials: int, seed: int,
               after: Callable[[int, Path], bool | None] | None = None) -> list[Trial]:
    """`trials` trials on a copy of the store at `source` made in `work`; `after(i, root)`, called
    with the damaged store, may return whether a run over it ended with the undamaged bytes."""
    root = work / "store"
    shutil.copytree(source, root, symlinks=True)
    store = ArtifactStore(root, contracts=contracts())
    outputs = outputs_of(store)
    results = []
    for i in range(trials):
        rng = random.Random(f"{seed}:{i}")
        kind, chosen = list(KINDS)[i % len(KINDS)], rng.choice(outputs)
        harm = KINDS[kind](store, chosen, rng)
        named, by_sha256, by_size, spurious = check(store, harm, outputs)
        results.append(Trial(kind, f"{chosen.stage}: {harm.what}", named, by_sha256, by_size, harm.unhashed,
                             spurious, after(i, root) if after else None))
        restore(root, source, harm.touched)
    if left := [entry.path for entry in store.survey() if entry.kind == "unknown" or entry.problems]:
        raise RuntimeError(f"store-fuzz: the store was not restored: {left}")
    return results


# --- the bench: runs over damaged stores, the table -------------------------------------------------

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
    return subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", *overrides, *more],
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
    args = parser.parse_args(argv)
    logging.getLogger("gristmill.store").setLevel(logging.ERROR)  # each refusal's warning: the table says it
    overrides = args.overrides if args.home else [*SHORT, *args.overrides]
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
