"""The align stage's GRPO method: verifiable-reward RL on math prompts with TRL's `GRPOTrainer`.

Each step samples `num_generations` completions per prompt; a completion's advantage is its reward
minus the mean reward of its group (scaled per `scale_rewards`), so no value model is needed.
Rewards (tasks.rewards): 1 for the right final number, plus `format_weight` for ending with the
answer sentence. `kl_beta` > 0 adds a per-token KL penalty to the SFT model (with LoRA: the same
model with its adapters off).

Prompts whose text hashes into the test bucket (`tasks.arithmetic.split_of`, the rule that keeps
the demo's test problems out of SFT) are held out; greedy accuracy on them is measured before
and after training, so "GRPO helped" is a claim on problems it never trained on.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from tasks import arithmetic
from tasks.align import CHECKPOINT_DIR, Config, prepare_model, train_resumably, trainer_args
from tasks.chat import prompt_ids
from tasks.rewards import MathPrompt, format_reward, load_math_prompts, numeric_match_reward
from tasks.stage import read_metrics

log = logging.getLogger("gristmill.align")

REWARD_FUNCS = [numeric_match_reward, format_reward]  # weights: 1 and settings.format_weight
EVAL_BATCH = 32  # prompts per greedy generation batch in the held-out evaluation
REWARD_WINDOW_FRAC = 0.1  # share of the steps averaged for the start/end training reward


def load_prompts(config: Config, tokenizer: Any) -> tuple[list[MathPrompt], list[MathPrompt], dict[str, int]]:
    """(train, held-out) prompts and drop counts: prompts that leave no room for
    `max_completion_len` tokens within `max_seq_len` are dropped as `prompt_too_long`."""
    settings, drops = config.grpo, {"prompt_too_long": 0}
    train: list[MathPrompt] = []
    heldout: list[MathPrompt] = []
    for source in settings.prompts:
        prompts, dropped = load_math_prompts(source, None, seed=config.seed)
        for reason, n in dropped.items():
            drops[reason] = drops.get(reason, 0) + n
        for p in prompts:
            if len(prompt_ids(tokenizer, p["prompt"])) + settings.max_completion_len > config.max_seq_len:
                drops["prompt_too_long"] += 1
            else:
                (heldout if arithmetic.split_of(p["prompt"][-1]["content"]) == "test" else train).append(p)
    train, heldout = train[: settings.max_prompts], heldout[: settings.heldout_prompts]
    if not train or not heldout:
        raise ValueError(f"{settings.prompts} give {len(train)} training and {len(heldout)} held-out prompts "
                         f"within max_seq_len={config.max_seq_len} (dropped: {drops})")
    return train, heldout, drops


@torch.no_grad()
def heldout_scores(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[MathPrompt],
                   max_new_tokens: int, device: torch.device) -> dict[str, float]:
    """Greedy-decoding accuracy (numeric match) and format rate on `prompts`."""
    from tasks.evaluate import generate_greedy

    model.eval()
    completions: list[str] = []
    for start in range(0, len(prompts), EVAL_BATCH):
        batch = [prompt_ids(tokenizer, p["prompt"]) for p in prompts[start: start + EVAL_BATCH]]
        completions += generate_greedy(model, tokenizer, batch, max_new_tokens, str(device))
    answers = [p["answer"] for p in prompts]
    accuracy = numeric_match_reward(completions, answers)
    formatted = format_reward(completions)
    return {"accuracy": sum(accuracy) / len(prompts), "format": sum(formatted) / len(prompts)}


def build_grpo_trainer(config: Config, model: Any, tokenizer: Any, train: list[MathPrompt],
                       out_dir: Path, use_cpu: bool) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    s = config.grpo
    args = GRPOConfig(**trainer_args(config, out_dir / CHECKPOINT_DIR, use_cpu),
                      per_device_train_batch_size=config.batch_size * s.num_generations,
                      num_generations=s.num_generations, max_completion_length=s.max_completion_len,
                      temperature=s.temperature, beta=s.kl_beta, reward_weights=[1.0, s.format_weight],
                      scale_rewards=s.scale_rewards,
                      # a fresh group per step (no reuse of stale samples), rewards kept per function
                      num_iterations=1, log_completions=False)
    return GRPOTrainer(model=prepare_model(config, model), reward_funcs=REWARD_FUNCS, args=args,
                       processing_class=tokenizer, train_dataset=Dataset.from_list(train))


def reward_trend(metrics_path: Path, steps: int) -> dict[str, float]:
    """Mean training reward over the first and the last `REWARD_WINDOW_FRAC` of the steps."""
    rewards = [r["reward"] for r in read_metrics(metrics_path) if "reward" in r]
    if not rewards:
        return {}
    window = max(1, round(steps * REWARD_WINDOW_FRAC))
    return {"train_reward_start": sum(rewards[:window]) / len(rewards[:window]),
            "train_reward_end": sum(rewards[-window:]) / len(rewards[-window:])}


def run_grpo(config: Config, model: Any, tokenizer: Any, out_dir: Path,
             use_cpu: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    train, heldout, drops = load_prompts(config, tokenizer)
    trainer = build_grpo_trainer(config, model, tokenizer, train, out_dir, use_cpu)
    device, max_new = trainer.accelerator.device, config.grpo.max_completion_len
    # A resume loads the trained weights only inside train(): this is still the SFT model.
    before = heldout_scores(trainer.model, tokenizer, heldout, max_new, device)
    summary, resumed_step = train_resumably(trainer, out_dir)
    after = heldout_scores(trainer.model, tokenizer, heldout, max_new, device)
    log.info("held-out accuracy %.3f -> %.3f, format %.3f -> %.3f (%d prompts)",
             before["accuracy"], after["accuracy"], before["format"], after["format"], len(heldout))
    steps = trainer.state.global_step
    return trainer.model, {
        "prompts_train": len(train), "prompts_heldout": len(heldout), "steps": steps,
        "resumed_from_step": resumed_step, "train_loss": summary.training_loss,
        **reward_trend(out_dir / "metrics.jsonl", steps),
        **{f"heldout_{k}_before": v for k, v in before.items()},
        **{f"heldout_{k}_after": v for k, v in after.items()},
        **{f"dropped_{reason}": n for reason, n in sorted(drops.items())},
    }
