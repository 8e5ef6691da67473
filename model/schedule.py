"""Learning-rate schedules as pure multipliers of the peak LR (for `torch.optim.lr_scheduler.LambdaLR`)."""
from __future__ import annotations

import math


def warmup_cosine(step: int, total_steps: int, warmup_frac: float, min_lr_ratio: float) -> float:
    """LR multiplier for optimizer step `step` (0-based): linear warmup over the first
    `warmup_frac * total_steps` steps, then cosine decay from 1 to `min_lr_ratio` at the last step.

    Warmup is `(step + 1) / warmup_steps` so that the very first update already moves the weights.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    warmup_steps = round(warmup_frac * total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(step: int, total_steps: int, warmup_frac: float, decay_frac: float,
                        min_lr_ratio: float) -> float:
    """LR multiplier of warmup-stable-decay (WSD): the same linear warmup as `warmup_cosine`, the
    peak held constant, then a linear decay to `min_lr_ratio` over the last `decay_frac * total_steps`
    steps (reached at the last step). A run can be extended from any stable-phase checkpoint."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    warmup_steps = round(warmup_frac * total_steps)
    decay_steps = round(decay_frac * total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return 1.0 - (1.0 - min_lr_ratio) * progress


def warmup_linear(step: int, total_steps: int, warmup_frac: float) -> float:
    """LR multiplier with the same linear warmup, then a linear decay to 0 after the last step
    (the "linear" schedule of transformers' Trainer, which the TRL-trained methods use)."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    warmup_steps = round(warmup_frac * total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def lr_multiplier(step: int, total_steps: int, schedule: str, warmup_frac: float, decay_frac: float,
                  min_lr_ratio: float) -> float:
    """The multiplier of the named schedule ("cosine" or "wsd") at `step`."""
    if schedule == "cosine":
        return warmup_cosine(step, total_steps, warmup_frac, min_lr_ratio)
    if schedule == "wsd":
        return warmup_stable_decay(step, total_steps, warmup_frac, decay_frac, min_lr_ratio)
    raise ValueError(f"unknown schedule {schedule!r}; use 'cosine' or 'wsd'")
