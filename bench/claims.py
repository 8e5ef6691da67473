"""Learning claims over seeds: how much each alignment method gains over its measured "before".

    GRISTMILL_HOME=... python -m bench claims [--seeds 0,1,2,3,4] [--methods grpo,dpo,ppo] [--smoke] [overrides ...]

Needs a GRISTMILL_HOME where `gristmill run configs/tiny.yaml --until sft` (with the same
overrides) has finished: the align stage runs on that SFT model once per method and seed, with the
method's seeds (data order, held-out split, sampling, initialisation) set to the seed. Printed per
run, and as min/median/max per claim (the end-to-end tests' thresholds sit below the minimum):

    grpo  heldout_accuracy, heldout_format     greedy accuracy / answer format on held-out problems
    dpo   heldout_logp_acc, heldout_logp_margin  how often / by how many nats the policy prefers the
                                               chosen reply, against the SFT model's measured values
    ppo   heldout_rm_accuracy                  trained reward model vs its untrained head (this
                                               seed's draw, and the mean over 32 random heads)
          heldout_rm_score                     reward-model score of greedy replies, PPO vs SFT

`--smoke`: seed 0, each method a step or two on a few pairs (bench/smoke.py ALIGN, after the
overrides given: they leave the SFT model the same).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import smoke

CLAIMS = {"grpo": ("heldout_accuracy", "heldout_format"), "dpo": ("heldout_logp_acc", "heldout_logp_margin"),
          "ppo": ("heldout_rm_accuracy", "heldout_rm_score")}


def _seeded(align: Any, method: str, seed: int) -> Any:
    """The align config with `method` chosen and all of that method's seeds set to `seed`."""
    section = getattr(align, method)
    if method == "ppo":
        section = section.model_copy(update={"reward_model": section.reward_model.model_copy(update={"seed": seed}),
                                             "policy": section.policy.model_copy(update={"seed": seed})})
    else:
        section = section.model_copy(update={"seed": seed})
    return align.model_copy(update={"method": method, method: section})


def _sft_manifest(overrides: list[str]) -> Any:
    from gristmill.flows.config import load_config
    from gristmill.flows.dag import plan
    from gristmill.infra import env
    from gristmill.infra.artifacts import home_store

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", overrides)
    store = home_store(env.gristmill_home())
    sft = next(p for p in plan(config, store, until="sft") if p.spec.name == "sft")
    manifest = store.load("sft", sft.key)
    if manifest is None:
        raise SystemExit(f"no finished sft stage for this config in {env.gristmill_home()}; run "
                         "`gristmill run configs/tiny.yaml --until sft` with the same overrides first")
    return config, manifest


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--methods", default="grpo,dpo,ppo")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = smoke.parse(parser, argv, seeds="0", note="each method a step or two on a few pairs")
    if args.smoke:
        args.overrides = [*args.overrides, *smoke.ALIGN]

    import torch

    from gristmill.core.stage import SerialEngine
    from gristmill.infra import env
    from gristmill.tasks.align.stage import run

    env.configure()
    torch.set_num_threads(2)
    config, sft = _sft_manifest(args.overrides)
    gains: dict[str, list[float]] = {}
    for method in args.methods.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            with tempfile.TemporaryDirectory() as tmp:
                started = time.perf_counter()
                stats = run(_seeded(config.align, method, seed), Path(tmp), engine=SerialEngine(),
                            store_mapping=None, sft=sft).stats
            row = {"method": method, "seed": seed, "seconds": round(time.perf_counter() - started, 1)}
            for claim in CLAIMS[method]:
                before, after = stats[f"{claim}_before"], stats[f"{claim}_after"]
                row[claim] = {"before": round(before, 4), "after": round(after, 4), "gain": round(after - before, 4)}
                gains.setdefault(f"{method}.{claim}", []).append(after - before)
            if method == "ppo":  # against the untrained baseline as a mean over random heads
                gain = stats["heldout_rm_accuracy_after"] - stats["heldout_rm_accuracy_untrained_mean"]
                row["rm_accuracy_over_untrained_mean"] = round(gain, 4)
                gains.setdefault("ppo.rm_accuracy_over_untrained_mean", []).append(gain)
            print(json.dumps(row), flush=True)
    summary = {claim: {"min": round(min(g), 4), "median": round(statistics.median(g), 4), "max": round(max(g), 4),
                       "seeds": len(g)} for claim, g in gains.items()}
    print(json.dumps({"gain": summary}))
    return 0
