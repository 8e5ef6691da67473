"""Cluster benchmark: the tiny preset's pretrain on two Ray nodes (one worker each), the nodes
sharing only a bucket against the same nodes sharing a disk, side by side:

    python -m bench cluster [--repeats 3] [--steps 100] [--checkpoint-every 25] [--upstream HOME] [--smoke]
                            [overrides ...]

One cluster serves both sides: the head and a second node on this machine (tests/ray_cluster.py),
the second in a mount namespace of its own with an empty tmpfs over the system temp dir.

- `s3` and `gcs`: GRISTMILL_HOME under the temp dir (so the second node has none of it), the
  artifacts and the training checkpoints on a bucket (GRISTMILL_STORE): moto's S3 server, or the
  Google Cloud Storage emulator, on 127.0.0.1 (bench/harness/emulators.py);
- `shared`: GRISTMILL_HOME outside the temp dir (both nodes see it: a shared disk), the artifacts
  and checkpoints there.

Each repeat runs every side (in turns, a different one first each round, so a noisy shared machine
weighs on all alike) in a fresh home holding the same collect and tokenize artifacts, computed once
beforehand (or copied from `--upstream HOME`, a run of the same overrides that holds them). Per
side: the median seconds of the pretrain stage (its manifest's meta.seconds: the Ray Train launch,
training, checkpoints, and on a bucket rank 0's outputs through it) and the median of its mean
seconds a checkpoint (the stage's `checkpoint_s` stat: writing, and on a bucket uploading). The last
line is one JSON object: wall_ratio (each bucket's / shared's), stage_s and checkpoint_s per side. Overrides
given apply to every run (the upstream and both sides).

`--smoke`: one round of 4 steps, a checkpoint every 2, the preset shrunk to seconds a stage
(bench/smoke.py RUN) unless overrides are given.
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
from collections.abc import Iterator
from pathlib import Path

from bench import smoke
from bench.harness import emulators

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench"
# Other services a caller's environment may name: each run here uses its own embedded ones.
SERVICE_VARS = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", "PREFECT_HOME", "GRISTMILL_STORE")
UPSTREAM = ("collect", "tokenize")


def _env(home: Path, extra: dict[str, str]) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in SERVICE_VARS}
    return {**environ, "GRISTMILL_HOME": str(home), **extra}


def _run(home: Path, args: list[str], extra: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *args], cwd=REPO,
                          env=_env(home, extra), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"gristmill run {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def _committed(home: Path, stage: str) -> Path:
    return next((home / "artifacts" / stage).glob("*/manifest.json")).parent


@contextlib.contextmanager
def _cluster(root: Path) -> Iterator[dict[str, str]]:
    """The test suite's two-node cluster, the second node on a private disk (the system temp dir)."""
    from tests.ray_cluster import two_ray_nodes

    with two_ray_nodes(root, worker_ports=22000) as cluster:  # beside a test suite's cluster (21000-21199)
        yield dict(cluster)


def _pretrain(seed: Path, home: Path, args: list[str], services: dict[str, str]) -> dict[str, float]:
    """One run of the pretrain stage in the fresh `home` (the seed's upstream artifacts copied in):
    its seconds and mean checkpoint seconds."""
    for stage in UPSTREAM:
        source = _committed(seed, stage)
        shutil.copytree(source, home / "artifacts" / stage / source.name)
    _run(home, args, services)
    manifest = json.loads((_committed(home, "pretrain") / "manifest.json").read_text())
    assert manifest["meta"]["launch"]["nodes"] == 2, manifest["meta"]["launch"]
    return {"seconds": manifest["meta"]["seconds"],
            "checkpoint_s": manifest["stats"].get("checkpoint_s", float("nan"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="pretrain.max_steps")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--upstream", type=Path, help="a GRISTMILL_HOME holding collect and tokenize of the same "
                        "overrides (default: computed first)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides of every run")
    args = smoke.parse(parser, argv, repeats=1, steps=4, checkpoint_every=2, overrides=smoke.RUN)
    pretrain = [*args.overrides, f"pretrain.max_steps={args.steps}",
                f"pretrain.checkpoint_every={args.checkpoint_every}", "pretrain.launch.backend=ray",
                "pretrain.launch.processes=1", "pretrain.launch.nodes=2", "--until", "pretrain"]
    private_root = Path(tempfile.mkdtemp(prefix="gristmill-bench-cluster-"))  # the second node has none of it
    shared_root = Path(tempfile.mkdtemp(prefix="gristmill-bench-cluster-", dir="/var/tmp"))  # both nodes see it
    runs: dict[str, list[dict[str, float]]] = {"s3": [], "gcs": [], "shared": []}
    try:
        seed = args.upstream or shared_root / "seed"
        if args.upstream is None:  # on this machine's own Ray: the upstream both sides reuse
            _run(seed, [*args.overrides, "--until", "tokenize"], {})
        with emulators.s3_server(BUCKET) as aws, emulators.gcs_server(BUCKET) as gcs, \
                _cluster(private_root / "ray") as cluster:
            buckets = {"s3": (aws, f"s3://{BUCKET}"), "gcs": (gcs, f"gs://{BUCKET}")}
            for round_ in range(args.repeats):
                sides = list(runs)[round_ % len(runs):] + list(runs)[:round_ % len(runs)]
                for side in sides:
                    # the node's object cache too: on the second node's own disk, or on the shared one
                    root = shared_root if side == "shared" else private_root
                    services = {**cluster, "GRISTMILL_CACHE": str(root / "cache" / side)}
                    if side in buckets:
                        variables, url = buckets[side]
                        services.update(variables, GRISTMILL_STORE=f"{url}/round-{round_}")
                    runs[side].append(_pretrain(seed, root / f"home-{side}-{round_}", pretrain, services))
                    print(f"round {round_} {side}: {runs[side][-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(private_root, ignore_errors=True)
        shutil.rmtree(shared_root, ignore_errors=True)
    medians = {side: {key: statistics.median(r[key] for r in rows) for key in ("seconds", "checkpoint_s")}
               for side, rows in runs.items()}
    print(f"{'side':<8}{'median stage s':>15}{'median checkpoint s':>21}   per round")
    for side, rows in runs.items():
        print(f"{side:<8}{medians[side]['seconds']:>15.1f}{medians[side]['checkpoint_s']:>21.3f}   "
              + ", ".join(f"{r['seconds']:.1f}/{r['checkpoint_s']:.3f}" for r in rows))
    print(json.dumps({"benchmark": "cluster", "repeats": args.repeats, "steps": args.steps,
                      "wall_ratio": {side: round(medians[side]["seconds"] / medians["shared"]["seconds"], 3)
                                     for side in ("s3", "gcs")},
                      "stage_s": {side: round(m["seconds"], 1) for side, m in medians.items()},
                      "checkpoint_s": {side: round(m["checkpoint_s"], 4) for side, m in medians.items()}}))
    return 0
