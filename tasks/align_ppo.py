"""The align stage's PPO method (RLHF): a Bradley–Terry reward model, then PPO against it.

1. The reward model (tasks/reward_model.py) trains on the method's preference pairs: a scalar
   head on the SFT model, held-out pair accuracy before and after.
2. PPO (model/ppo.py; TRL 1.16 has no PPO trainer) samples responses to the training pairs'
   prompts, scores them with the reward model, and optimises the SFT policy with a value head,
   GAE and clipped objectives, under a per-token KL penalty to the frozen SFT model.
3. Held out: the mean reward-model score of greedy responses to the held-out prompts, before
   (the SFT model) and after PPO.

Resume: a finished reward model is reused (its stats file marks it), PPO continues from its last
checkpoint under `checkpoints/ppo`, which the stage deletes once the model is exported. The
reward model stays in `reward_model/` for later scoring (e.g. win rates).
"""
from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from model.ppo import ppo_train
from tasks.align import CHECKPOINT_DIR, Config, load_pairs, split_heldout
from tasks.chat import Message, prompt_ids
from tasks.reward_model import RM_CHECKPOINT_DIR, RewardScorer, train_reward_model
from tasks.stage import MetricsLog

log = logging.getLogger("gristmill.align")
EVAL_BATCH = 32  # prompts per greedy generation batch


def greedy_score(policy: Any, tokenizer: Any, prompts: Sequence[list[Message]], scorer: RewardScorer,
                 max_new_tokens: int) -> float:
    """Mean reward-model score of the policy's greedy responses."""
    from tasks.evaluate import generate_greedy

    policy.eval()
    device = str(next(policy.parameters()).device)
    texts: list[str] = []
    for start in range(0, len(prompts), EVAL_BATCH):
        batch = [prompt_ids(tokenizer, p) for p in prompts[start:start + EVAL_BATCH]]
        texts += generate_greedy(policy, tokenizer, batch, max_new_tokens, device)
    return float(scorer(list(prompts), texts).mean())


def run_ppo(config: Config, model: Any, tokenizer: Any, out_dir: Path,
            use_cpu: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    if config.lora is not None:
        raise ValueError("lora is not supported with method 'ppo' (its value head shares the "
                         "policy's trunk); use dpo or grpo, or set lora: null")
    settings = config.ppo
    pairs, drops = load_pairs(settings.data, settings.max_pairs, config.seed)
    train, heldout = split_heldout(pairs, settings.heldout_fraction, config.seed)
    metrics = MetricsLog(out_dir)
    rm_dir, rm_stats = train_reward_model(Path(model.name_or_path), train, heldout, settings.reward_model,
                                          out_dir, metrics)
    shutil.rmtree(out_dir / RM_CHECKPOINT_DIR, ignore_errors=True)
    device = torch.device("cpu" if use_cpu else "cuda")
    model.to(device)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    scorer = RewardScorer(rm_dir, device=str(device))
    heldout_prompts = [p["prompt"] for p in heldout]
    max_new = settings.policy.max_new_tokens
    before = greedy_score(reference, tokenizer, heldout_prompts, scorer, max_new)
    ppo_stats = ppo_train(model, reference, tokenizer, [p["prompt"] for p in train], scorer,
                          settings.policy, out_dir / CHECKPOINT_DIR / "ppo", metrics,
                          metrics_step_offset=rm_stats["rm_steps"])
    after = greedy_score(model, tokenizer, heldout_prompts, scorer, max_new)
    log.info("held-out reward-model score of greedy responses %.3f -> %.3f", before, after)
    return model, {**rm_stats, **ppo_stats, "prompts_train": len(train), "prompts_heldout": len(heldout),
                   "heldout_rm_score_before": before, "heldout_rm_score_after": after,
                   **{f"dropped_{reason}": n for reason, n in sorted(drops.items())}}
