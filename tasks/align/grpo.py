"""Method `grpo`: verifiable-reward RL on math prompts with TRL's `GRPOTrainer`.

Each step samples `num_generations` completions per prompt; a completion's advantage is its reward
minus the mean reward of its group (scaled per `scale_rewards`), so no value model is needed.
Rewards (tasks.align.rewards): 1 for the right final number, plus `format_weight` for ending with the
answer sentence. `kl_beta` > 0 adds a per-token KL penalty to the SFT model (with LoRA: the same
model with its adapters off).

Prompts whose text hashes into the test bucket (`gristmill.core.arithmetic.split_of`, the rule that keeps
the demo's test problems out of SFT) are held out; greedy accuracy on them is measured before
and after training, so "GRPO helped" is a claim on problems it never trained on.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import gristmill.core.arithmetic as arithmetic
from gristmill.core.chat import prompt_ids
from gristmill.core.stage import MetricsLog, read_metrics
from gristmill.model.checkpoint import CHECKPOINTS_DIR
from gristmill.model.generate import generate_greedy
from gristmill.tasks.align.config import GRPOConfig
from gristmill.tasks.align.method import AlignJob
from gristmill.tasks.align.rewards import (
    MathPrompt,
    format_reward,
    load_math_prompts,
    numeric_match_reward,
)
from gristmill.tasks.align.trl_common import train_resumably, trainer_args, with_lora

log = logging.getLogger("gristmill.align")

REWARD_FUNCS = [numeric_match_reward, format_reward]  # weights: 1 and config.format_weight
EVAL_BATCH = 32  # prompts per greedy generation batch in the held-out evaluation
REWARD_WINDOW_FRAC = 0.1  # share of the steps averaged for the start/end training reward


def load_prompts(config: GRPOConfig,
                 tokenizer: Any) -> tuple[list[MathPrompt], list[MathPrompt], dict[str, int]]:
    """(train, held-out) prompts and drop counts: prompts that leave no room for
    `max_completion_len` tokens within `max_seq_len` are dropped as `prompt_too_long`."""
    drops = {"prompt_too_long": 0}
    train: list[MathPrompt] = []
    heldout: list[MathPrompt] = []
    for source in config.prompts:
        prompts, dropped = load_math_prompts(source, None, seed=config.seed)
        for reason, n in dropped.items():
            drops[reason] = drops.get(reason, 0) + n
        for p in prompts:
            if len(prompt_ids(tokenizer, p["prompt"])) + config.max_completion_len > config.max_seq_len:
                drops["prompt_too_long"] += 1
            else:
                (heldout if arithmetic.split_of(p["prompt"][-1]["content"]) == "test" else train).append(p)
    train, heldout = train[: config.max_prompts], heldout[: config.heldout_prompts]
    if not train or not heldout:
        raise ValueError(f"{config.prompts} give {len(train)} training and {len(heldout)} held-out prompts "
                         f"within max_seq_len={config.max_seq_len} (dropped: {drops})")
    return train, heldout, drops


@torch.no_grad()
def heldout_scores(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[MathPrompt],
                   max_new_tokens: int, device: torch.device) -> dict[str, float]:
    """Greedy-decoding accuracy (numeric match) and format rate on `prompts`."""
    model.eval()
    completions = generate_greedy(model, tokenizer, [prompt_ids(tokenizer, p["prompt"]) for p in prompts],
                                  max_new_tokens, str(device), EVAL_BATCH)
    answers = [p["answer"] for p in prompts]
    accuracy = numeric_match_reward(completions, answers)
    formatted = format_reward(completions)
    return {"accuracy": sum(accuracy) / len(prompts), "format": sum(formatted) / len(prompts)}


def build_trainer(config: GRPOConfig, job: AlignJob, train: list[MathPrompt]) -> Any:
    from datasets import Dataset
    from trl.trainer.grpo_config import GRPOConfig as TrlGRPOConfig  # ours is the stage section
    from trl.trainer.grpo_trainer import GRPOTrainer

    s = config
    args = TrlGRPOConfig(**trainer_args(s, job.out_dir / CHECKPOINTS_DIR, s.batch_size * s.num_generations),
                          num_generations=s.num_generations, max_completion_length=s.max_completion_len,
                          temperature=s.temperature, beta=s.kl_beta, reward_weights=[1.0, s.format_weight],
                          scale_rewards=s.scale_rewards,
                          # a fresh group per step (no reuse of stale samples), rewards kept per function
                          num_iterations=1, log_completions=False)
    return GRPOTrainer(model=with_lora(job.model, job.lora, s.seed), reward_funcs=REWARD_FUNCS,
                           args=args, processing_class=job.tokenizer, train_dataset=Dataset.from_list(train))


def reward_trend(metrics_path: Path, steps: int) -> dict[str, float]:
    """Mean training reward over the first and the last `REWARD_WINDOW_FRAC` of the steps."""
    rewards = [r["reward"] for r in read_metrics(metrics_path) if "reward" in r]
    if not rewards:
        return {}
    window = max(1, round(steps * REWARD_WINDOW_FRAC))
    return {"train_reward_start": sum(rewards[:window]) / len(rewards[:window]),
            "train_reward_end": sum(rewards[-window:]) / len(rewards[-window:])}


def train(config: GRPOConfig, job: AlignJob) -> tuple[torch.nn.Module, dict[str, Any]]:
    train_prompts, heldout, drops = load_prompts(config, job.tokenizer)
    trainer = build_trainer(config, job, train_prompts)
    device, max_new = trainer.accelerator.device, config.max_completion_len
    # A resume loads the trained weights only inside train(): this is still the SFT model.
    before = heldout_scores(trainer.model, job.tokenizer, heldout, max_new, device)
    summary, resumed_step = train_resumably(trainer, config, MetricsLog(job.out_dir))
    after = heldout_scores(trainer.model, job.tokenizer, heldout, max_new, device)
    log.info("held-out accuracy %.3f -> %.3f, format %.3f -> %.3f (%d prompts)",
             before["accuracy"], after["accuracy"], before["format"], after["format"], len(heldout))
    steps = trainer.state.global_step
    return trainer.model, {
        "prompts_train": len(train_prompts), "prompts_heldout": len(heldout), "steps": steps,
        "resumed_from_step": resumed_step, "train_loss": summary.training_loss,
        **reward_trend(job.out_dir / "metrics.jsonl", steps),
        **{f"heldout_{k}_before": v for k, v in before.items()},
        **{f"heldout_{k}_after": v for k, v in after.items()},
        **{f"dropped_{reason}": n for reason, n in sorted(drops.items())},
    }
