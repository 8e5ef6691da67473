"""`gristmill run --dry-run --explain` over a store that holds many runs.

    python -m bench explain [--runs 100] [--repeats 5] [--smoke]

Fills a fresh store with the manifests of `--runs` earlier runs of the tiny preset (each run a
different pretrain.lr and seed, so every training stage has `--runs` artifacts, and collect and
tokenize one each), then times the CLI: `--dry-run` alone and `--dry-run --explain` with one more
pretrain.lr, so pretrain and everything after it must be explained against all `--runs`
artifacts of their stage. Wall seconds of the whole command (a fresh interpreter), medians of
`--repeats`. The last line is one JSON object with `explain_s` (goal <= 2), `dry_run_s` and
their difference, `explain_cost_s`.
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

from bench import smoke

REPO = Path(__file__).resolve().parents[1]


def _fill(root: Path, runs: int) -> None:
    """The manifests `runs` runs would have committed (no files: planning reads manifests only)."""
    from gristmill.flows.config import load_config
    from gristmill.flows.dag import plan
    from gristmill.infra.artifacts import ArtifactStore

    store = ArtifactStore(root)
    for run in range(runs):
        config = load_config(REPO / "configs" / "tiny.yaml", [f"pretrain.lr={0.001 + run * 1e-5:.5f}",
                                                              f"sft.seed={run}"])
        planned = plan(config, store)
        keys = {stage.spec.name: stage.key for stage in planned}
        for stage in planned:
            directory = store.final_dir(stage.spec.name, stage.key)
            if directory.exists():
                continue
            directory.mkdir(parents=True)
            (directory / "manifest.json").write_text(json.dumps({
                "stage": stage.spec.name, "key": stage.key, "files": {}, "stats": {},
                "config": stage.config.model_dump(mode="json"),
                "upstream": {name: keys[name] for name in stage.spec.upstream},
                "meta": {"stage_version": stage.spec.version, "inputs_fingerprint": stage.inputs_fingerprint}}))


def _seconds(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench explain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = smoke.parse(parser, argv, runs=2, repeats=1)
    with tempfile.TemporaryDirectory(prefix="bench-explain-") as home:
        env = {**os.environ, "GRISTMILL_HOME": home}
        os.environ["GRISTMILL_HOME"] = home
        _fill(Path(home) / "artifacts", args.runs)
        command = [sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", "pretrain.lr=0.0042", "--dry-run"]
        times: dict[str, list[float]] = {"dry_run_s": [], "explain_s": []}
        for _ in range(args.repeats):
            times["dry_run_s"].append(_seconds(command, env))
            times["explain_s"].append(_seconds([*command, "--explain"], env))
    medians = {name: round(statistics.median(t), 3) for name, t in times.items()}
    print(f"a store of {args.runs} runs; medians of {args.repeats}: dry run {medians['dry_run_s']} s, "
          f"with --explain {medians['explain_s']} s")
    print(json.dumps({"runs": args.runs, **medians,
                      "explain_cost_s": round(medians["explain_s"] - medians["dry_run_s"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
