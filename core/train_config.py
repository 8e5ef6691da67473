"""The optimisation and checkpointing config every trainer shares, declared once.

Pretraining and SFT (model/loop.py), the reward model, DPO and GRPO (TRL trainers) and PPO
(model/ppo.py) all take their optimiser, schedule length, seed, device and checkpoint cadence
from this one type: one name, one default and one description per knob. A trainer's own config
class subclasses it and adds only what is particular to it; presets (configs/*.yaml) set the
values each stage wants.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from gristmill.core.stage import StageConfig


class TrainConfig(StageConfig):
    """Optimiser (AdamW), run length, seed, device and checkpoint cadence of one training run."""

    # Operational: they change when and what is written or logged, never the trained weights.
    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"checkpoint_every", "keep_checkpoints", "log_every"})

    max_steps: int = Field(default=200, gt=0, description="Optimizer steps to train for.")
    batch_size: int = Field(default=8, gt=0, description=(
        "Examples per optimizer step, across all processes: sequences (pretrain, SFT), preference "
        "pairs (reward model, DPO), prompts (GRPO: each sampled num_generations times; PPO: one "
        "rollout each)."))
    lr: float = Field(default=3e-4, gt=0, description=(
        "Peak learning rate (of AdamW, and of Muon when optimizer is muon)."))
    warmup_frac: float = Field(default=0.1, ge=0, lt=1, description=(
        "Share of max_steps spent in linear LR warmup from 0."))
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW decoupled weight decay.")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(default=0.95, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(default=1.0, ge=0, description="Max global gradient L2 norm; 0 disables clipping.")
    seed: int = Field(default=0, description="Seed of initialisation, data order, held-out splits and sampling.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: CUDA when available, else CPU. bf16 autocast is used on CUDA only.")
    checkpoint_every: int = Field(
        default=50, gt=0, description="Save a resumable checkpoint every N steps (and after the last).")
    keep_checkpoints: int = Field(default=2, gt=0, description=(
        "Most recent complete checkpoints kept on disk while training."))
    log_every: int = Field(default=10, gt=0, description="Log a one-line progress summary every N steps "
                                                          "(metrics.jsonl gets every step; on a terminal a progress "
                                                          "bar replaces these lines on the console).")
