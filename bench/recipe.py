"""The pretraining recipe against compressors: val_bpb per change and per FLOP budget.

    python -m bench recipe TOKENIZE_DIR [--changes NAME ...] [--seeds 0,1,2,3,4] [--change-steps N]
                           [--steps 150 300 600 1200] [--val-windows 160] [--target-bpb 1.891] [--out DIR]
                           [--smoke]

TOKENIZE_DIR is a tokenize artifact (`gristmill run configs/tiny.yaml --until tokenize`). Each run
is `python -m gristmill.tasks.pretrain TOKENIZE_DIR OUT --config JSON`, one at a time: first each change in
`CHANGES` on top of `RECIPE` (the best recipe measured, docs/benchmarks.md) over the tiny preset's
`pretrain:` section (configs/tiny.yaml; its steps unless `--change-steps`), once per seed of `--seeds`
(default 0), with each change's val_bpb minus the recipe's per seed, then the recipe at each of
`--steps`, seed 0 (the FLOP curve; the cosine schedule spans each run's own length).
Pretraining FLOPs are the manifest's (`gristmill.model.plan.flops_per_token` × tokens). `--target-bpb` is
the figure to cross, e.g. the evaluate stage's `compression_xz_given_train_bpb` on the same split;
the crossing is interpolated (or extrapolated, and said so) linearly in log FLOPs between the two
nearest budgets. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench import smoke
from gristmill.model.config import ModelConfig
from gristmill.model.plan import flops_per_token

ROOT = Path(__file__).resolve().parent.parent
# The best recipe measured, as overrides of the preset's pretrain section.
RECIPE: dict[str, Any] = {"optimizer": "muon", "lr": 1e-2, "batch_size": 16, "seq_len": 128}
# Changes to RECIPE, one at a time: name -> overrides.
CHANGES: dict[str, dict[str, Any]] = {
    "recipe": {},
    "adamw_preset": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 8, "seq_len": 256},  # the preset's recipe
    "adamw_lr3e-3": {"optimizer": "adamw", "lr": 3e-3},
    "batch8_seq256": {"batch_size": 8, "seq_len": 256},
    "lr5e-3": {"lr": 5e-3},
    "lr2e-2": {"lr": 2e-2},
    "wsd": {"schedule": "wsd", "decay_frac": 0.3},
    "weight_decay0": {"weight_decay": 0.0},
    "layers3": {"model": {"num_layers": 3}},
}


def preset_pretrain(steps: int | None = None, val_windows: int = 160) -> dict[str, Any]:
    """The tiny preset's pretrain section with a fixed validation set and no mid-run checkpoints."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["pretrain"]
    cfg.setdefault("model", {})
    cfg.update(val_windows=val_windows, checkpoint_every=10**6, eval_every=0)
    if steps is not None:
        cfg["max_steps"] = steps
    return cfg


def with_change(cfg: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = {**cfg, **{k: v for k, v in change.items() if k != "model"}}
    out["model"] = {**cfg["model"], **change.get("model", {})}
    return out


def pretrain(tokenize_dir: Path, cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    """One pretraining run in a child process; its summary plus FLOPs and wall seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gristmill.tasks.pretrain", str(tokenize_dir), str(out), "--config",
                    json.dumps(cfg)], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    summary = json.loads((out / "summary.json").read_text())
    vocab = json.loads((tokenize_dir / "manifest.json").read_text())["config"]["vocab_size"]
    fpt = flops_per_token(ModelConfig(**cfg["model"]), vocab, cfg["seq_len"])
    return {"val_bpb": summary["val_bpb"], "tokens": summary["tokens_seen"], "flops": fpt * summary["tokens_seen"],
            "wall_s": wall}


def crossing(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """FLOPs where val_bpb reaches `target`, linear in log FLOPs between the two nearest budgets."""
    pts = sorted((r["flops"], r["val_bpb"]) for r in curve)
    if len(pts) < 2:
        return None
    pairs = list(itertools.pairwise(pts))
    inside = [(a, b) for a, b in pairs if min(a[1], b[1]) <= target <= max(a[1], b[1])]
    (f0, y0), (f1, y1) = inside[0] if inside else pairs[-1]
    if y0 == y1:
        return None
    x = math.log(f0) + (target - y0) * (math.log(f1) - math.log(f0)) / (y1 - y0)
    return {"flops": math.exp(x), "extrapolated": not inside}


def _gains_over_recipe(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """change -> its val_bpb minus the recipe's, per seed both ran (positive: the recipe is better)."""
    recipe = {r["seed"]: r["val_bpb"] for r in rows if r["run"] == "recipe"}
    names = dict.fromkeys(r["run"] for r in rows if r["run"] != "recipe")
    return {name: [r["val_bpb"] - recipe[r["seed"]] for r in rows if r["run"] == name and r["seed"] in recipe]
            for name in names}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench recipe", description=__doc__.splitlines()[0])
    ap.add_argument("tokenize_dir", type=Path)
    ap.add_argument("--changes", nargs="*", default=list(CHANGES), choices=list(CHANGES))
    ap.add_argument("--steps", nargs="*", type=int, default=[150, 300, 600, 1200])
    ap.add_argument("--val-windows", type=int, default=160)
    ap.add_argument("--target-bpb", type=float, default=1.891)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seeds", default="0", help="comma-separated pretraining seeds of the changes")
    ap.add_argument("--change-steps", type=int, help="steps of each change's run (default: the preset's)")
    args = smoke.parse(ap, argv, changes=["recipe", "layers3"], seeds="0", change_steps=2, steps=[2, 3],
                       val_windows=2)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-recipe-"))
    seeds = [int(s) for s in args.seeds.split(",")]
    recipe, rows = with_change(preset_pretrain(args.change_steps, args.val_windows), RECIPE), []
    for seed, name in itertools.product(seeds, args.changes):
        cfg = {**with_change(recipe, CHANGES[name]), "seed": seed}
        r = pretrain(args.tokenize_dir, cfg, out / f"{name}-seed{seed}")
        rows.append({"run": name, "seed": seed, **r})
        print(f"{name:>16} seed {seed} val_bpb {r['val_bpb']:.4f}  {r['flops'] / 1e12:6.2f} TFLOP  "
              f"{r['wall_s']:6.1f} s", flush=True)
    gains = _gains_over_recipe(rows)
    for name, per_seed in gains.items():
        print(f"{name:>16} minus recipe, per seed: {', '.join(f'{g:+.4f}' for g in per_seed)}")
    curve = []
    for steps in args.steps:
        r = pretrain(args.tokenize_dir, with_change(preset_pretrain(steps, args.val_windows), RECIPE),
                     out / f"steps{steps}")
        curve.append({"steps": steps, **r})
        print(f"{f'{steps} steps':>16} val_bpb {r['val_bpb']:.4f}  {r['flops'] / 1e12:6.2f} TFLOP  "
              f"{r['wall_s']:6.1f} s", flush=True)
    cross = crossing(curve, args.target_bpb)
    if cross:
        how = "extrapolated" if cross["extrapolated"] else "interpolated"
        print(f"crosses {args.target_bpb} bits/byte at {cross['flops'] / 1e12:.2f} TFLOP ({how}, log FLOPs)")
    print(json.dumps({"changes": rows, "gains_over_recipe": gains, "curve": curve,
                      "target_bpb": args.target_bpb, "crossing": cross}))
    return 0
