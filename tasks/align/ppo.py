"""Method `ppo` (RLHF): a Bradley–Terry reward model, then PPO against it.

1. The reward model (tasks/align/reward_model.py) trains on the method's preference pairs: a scalar
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gristmill.core.chat import Message, prompt_ids
from gristmill.core.stage import MetricsLog
from gristmill.model.checkpoint import CHECKPOINTS_DIR, checkpoint_place
from gristmill.model.generate import generate_greedy
from gristmill.model.loop import resolve_device
from gristmill.model.ppo import ppo_train
from gristmill.tasks.align.config import PPOMethodConfig
from gristmill.tasks.align.method import AlignJob
from gristmill.tasks.align.preferences import load_pairs, split_heldout
from gristmill.tasks.align.reward_model import (
    RM_CHECKPOINT_DIR,
    RewardScorer,
    train_reward_model,
)

log = logging.getLogger("gristmill.align")
EVAL_BATCH = 32  # prompts per greedy generation batch


def greedy_score(policy: Any, tokenizer: Any, prompts: Sequence[list[Message]], scorer: RewardScorer,
                 max_new_tokens: int) -> float:
    """Mean reward-model score of the policy's greedy responses."""
    policy.eval()
    device = str(next(policy.parameters()).device)
    texts = generate_greedy(policy, tokenizer, [prompt_ids(tokenizer, p) for p in prompts], max_new_tokens,
                            device, EVAL_BATCH)
    return float(scorer(list(prompts), texts).mean())


def train(config: PPOMethodConfig, job: AlignJob) -> tuple[torch.nn.Module, dict[str, Any]]:
    if job.lora is not None:
        raise ValueError("lora is not supported with method 'ppo' (its value head shares the "
                         "policy's trunk); use dpo or grpo, or set lora: null")
    split_seed = config.reward_model.seed
    pairs, drops = load_pairs(config.data, config.max_pairs, split_seed)
    train_pairs, heldout = split_heldout(pairs, config.heldout_fraction, split_seed)
    metrics = MetricsLog(job.out_dir)
    model = job.model
    if not model.name_or_path:
        raise ValueError("the SFT model to align was not loaded from a directory")
    rm_dir, rm_stats = train_reward_model(Path(model.name_or_path), train_pairs, heldout, config.reward_model,
                                          job.out_dir, metrics)
    shutil.rmtree(job.out_dir / RM_CHECKPOINT_DIR, ignore_errors=True)
    device = resolve_device(config.policy.device)
    # transformers wraps PreTrainedModel.to with functools.wraps, which the checker reads as an
    # unbound function (the device taken for `self`)
    model.to(device)  # pyright: ignore[reportArgumentType]
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    scorer = RewardScorer(rm_dir, device=str(device))
    heldout_prompts = [p["prompt"] for p in heldout]
    max_new = config.policy.max_new_tokens
    before = greedy_score(reference, job.tokenizer, heldout_prompts, scorer, max_new)
    checkpoints = checkpoint_place(job.out_dir / CHECKPOINTS_DIR / "ppo", job.store_mapping)
    ppo_stats = ppo_train(model, reference, job.tokenizer, [p["prompt"] for p in train_pairs], scorer,
                          config.policy, checkpoints, metrics, metrics_step_offset=rm_stats["rm_steps"])
    after = greedy_score(model, job.tokenizer, heldout_prompts, scorer, max_new)
    log.info("held-out reward-model score of greedy responses %.3f -> %.3f", before, after)
    return model, {**rm_stats, **ppo_stats, "prompts_train": len(train_pairs), "prompts_heldout": len(heldout),
                   "heldout_rm_score_before": before, "heldout_rm_score_after": after,
                   **{f"dropped_{reason}": n for reason, n in sorted(drops.items())}}
