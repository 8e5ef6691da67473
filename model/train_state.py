"""The training loop's state across checkpoints (model/loop.py): what a checkpoint holds, how it is
saved and loaded, resume, and rollback after a non-finite or spiking loss.

A checkpoint (model/checkpoint.py lays it out, on the local disk or a bucket) holds full, gathered
state, so a run may resume on another number of processes: `model.safetensors` (the full weights,
each tied tensor once) and `optimizer.pt` (by parameter name) written by rank 0, `scheduler.json`
(the LR scheduler as JSON), `rng-<rank>.pt` (each process's torch RNG states) and the loop state in
the marker. Nothing is unpickled freely: weights are safetensors, optimizer and RNG states load with
`weights_only=True`. A checkpoint of another global batch is refused.

Rollback restores the last complete checkpoint and skips every batch from it up to the offending
one; the skip is a persistent offset (batch index = step + skip_offset) kept in that checkpoint's
marker, so a resume after a rollback stays exact. After `max_rollbacks` the run stops with
TrainingDiverged.
"""
from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from accelerate import Accelerator

from gristmill.core.stage import MetricsLog
from gristmill.model.checkpoint import (
    Place,
    latest_good_checkpoint,
    read_marker,
    restore_rows,
    resume_point,
    save_checkpoint,
)
from gristmill.model.config import LoopConfig
from gristmill.model.parallel import (
    full_model_state,
    full_optimizer_state,
    is_rank0,
    load_model_state,
    load_optimizer_state,
)

SCHEDULER_FILE = "scheduler.json"  # the LR scheduler's state inside a checkpoint
MODEL_FILE = "model.safetensors"  # the full weights, each tied tensor once
OPTIMIZER_FILE = "optimizer.pt"  # the full optimizer state by parameter name; absent before the first step
RNG_FILE = "rng-{rank}.pt"  # each process's torch RNG states (adapter dropout)
# Floor of the rolling std as a fraction of the rolling mean loss: on a flat loss curve (std near
# 0) ordinary batch-to-batch noise must not count as a spike.
MIN_SPIKE_STD_FRAC = 0.01


class TrainingDiverged(RuntimeError):
    """Training kept producing non-finite or spiking losses after `max_rollbacks` rollbacks."""


def fresh_state(cfg: LoopConfig) -> dict[str, Any]:
    """Loop state at step 0; saved in each checkpoint's marker. `skip_offset`: batches skipped by
    rollbacks (step s trains on batch s + skip_offset: the data position); `loss_window`: recent
    losses for spike checks; `global_batch`: sequences per step, which a resume must keep."""
    return {"step": 0, "tokens_seen": 0, "recent_losses": [], "eval": {}, "skip_offset": 0, "rollbacks": 0,
            "loss_window": [], "global_batch": cfg.batch_size}


@dataclass
class Parts:
    """What the loop trains with; checkpoints hold the state of the last three."""

    accelerator: Accelerator
    model: torch.nn.Module  # as prepared: DDP-wrapped, sharded, or plain
    optimizer: Any  # Accelerate's wrapper of the optimizer
    scheduler: Any

    @property
    def module(self) -> torch.nn.Module:
        """The model without a DDP wrapper (a sharded model is its own)."""
        return self.accelerator.unwrap_model(self.model)

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer


def load_state(parts: Parts, path: Path, cfg: LoopConfig) -> dict[str, Any]:
    """Model, optimizer, scheduler and this rank's RNG states from `path`, read by rank 0 and
    broadcast (any world size, sharded or not); nothing is unpickled freely. A checkpoint of
    another global batch is refused."""
    marker = read_marker(path)
    saved_batch = marker.get("global_batch", cfg.batch_size)
    if saved_batch != cfg.batch_size:
        raise ValueError(f"the checkpoint {path} trained {saved_batch} sequences per step and this run "
                         f"{cfg.batch_size}: keep tokens_per_step (or batch_size) as it was, or train anew")
    load_model_state(parts.module, safetensors.torch.load_file(path / MODEL_FILE) if is_rank0() else {})
    optimizer = parts.inner_optimizer
    if (path / OPTIMIZER_FILE).is_file():
        saved = torch.load(path / OPTIMIZER_FILE, weights_only=True) if is_rank0() else {}
        load_optimizer_state(parts.module, optimizer, saved)
    else:  # a checkpoint from before the first step: the optimizer starts afresh
        optimizer.state.clear()
    rng = path / RNG_FILE.format(rank=parts.accelerator.process_index)
    if rng.is_file():
        states = torch.load(rng, weights_only=True)
        torch.set_rng_state(states["cpu"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["cuda"])
    parts.scheduler.load_state_dict(json.loads((path / SCHEDULER_FILE).read_text()))
    return {**fresh_state(cfg), **marker}


def save_state(parts: Parts, checkpoints: Place, state: dict[str, Any], keep: int,
               metrics: MetricsLog) -> dict[str, float]:
    """Every rank takes part (the state is gathered); rank 0 writes weights, optimizer and scheduler,
    every rank its RNG states. Before the first step the optimizer has no state and none is
    written: asking torch for it would create it with an optimizer step. Returns checkpoint_s
    (gathering, writing and any upload) and checkpoint_bytes."""
    started = time.perf_counter()
    model_bytes = sum(p.numel() * p.element_size() for p in parts.model.parameters())
    weights = full_model_state(parts.module)
    optimizer = full_optimizer_state(parts.module, parts.inner_optimizer) if parts.inner_optimizer.state else None

    def write(directory: Path) -> None:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, directory / RNG_FILE.format(rank=parts.accelerator.process_index))
        if is_rank0():
            safetensors.torch.save_file(weights, directory / MODEL_FILE)
            if optimizer is not None:
                torch.save(optimizer, directory / OPTIMIZER_FILE)
            (directory / SCHEDULER_FILE).write_text(json.dumps(parts.scheduler.state_dict()) + "\n")

    # weights + AdamW's two moments, about 3x the model in float32
    saved = save_checkpoint(checkpoints, state, keep, write, expected_bytes=3 * model_bytes,
                            main=parts.accelerator.is_main_process, barrier=parts.accelerator.wait_for_everyone,
                            metrics=metrics)
    return {**saved, "checkpoint_s": round(time.perf_counter() - started, 4)}


def resume(parts: Parts, checkpoints: Place, metrics: MetricsLog, cfg: LoopConfig, log: logging.Logger) -> dict:
    """Load the newest complete checkpoint that verifies, if any; returns its saved loop state."""
    accelerator = parts.accelerator
    good = resume_point(checkpoints, main=accelerator.is_main_process, barrier=accelerator.wait_for_everyone)
    if good is None:
        if accelerator.is_main_process:
            metrics.truncate_after(-1)  # entries from a run that crashed before its first checkpoint
        return fresh_state(cfg)
    step, path = good
    if step:
        log.info("resuming from step %d (%s)", step, path)
    state = load_state(parts, path, cfg)
    if accelerator.is_main_process:
        metrics.truncate_after(step)
        restore_rows(metrics, step, state, path)
    return state


def anomaly(loss: float, grad_norm: float, window: list[float], cfg: LoopConfig) -> str | None:
    """Why this step's result must not be kept ("non-finite" or "spike"), or None."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return "non-finite"
    if cfg.spike_zscore > 0 and len(window) >= cfg.spike_window:
        mean, std = statistics.fmean(window), statistics.pstdev(window)
        if loss > mean + cfg.spike_zscore * max(std, MIN_SPIKE_STD_FRAC * abs(mean)):
            return "spike"
    return None


def rollback(parts: Parts, checkpoints: Place, metrics: MetricsLog, state: dict[str, Any],
              loss: float, reason: str, cfg: LoopConfig, log: logging.Logger) -> dict[str, Any]:
    """Restore the last complete checkpoint and skip every batch from it up to the offending one;
    the new offset is written into that checkpoint's marker so a later resume keeps it."""
    failed, accelerator = state["step"] + 1, parts.accelerator
    if state["rollbacks"] >= cfg.max_rollbacks:
        raise TrainingDiverged(
            f"training loss is {loss} ({reason}) at step {failed} after {state['rollbacks']} rollbacks "
            f"(max_rollbacks={cfg.max_rollbacks}); lower lr, tighten grad_clip, or check the data")
    good = latest_good_checkpoint(checkpoints, main=accelerator.is_main_process)
    if good is None:
        raise TrainingDiverged(f"training loss is {loss} ({reason}) at step {failed} and no intact "
                               "checkpoint is left to roll back to")
    good_step, path = good
    saved = load_state(parts, path, cfg)
    skipped = failed - good_step  # the batches of steps good_step+1 .. failed
    state = {**saved, "skip_offset": state["skip_offset"] + skipped, "rollbacks": state["rollbacks"] + 1}
    log.warning("%s loss %.4g at step %d: rolled back to step %d, skipping %d batches (rollback %d of %d)",
                reason, loss, failed, good_step, skipped, state["rollbacks"], cfg.max_rollbacks)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoints.rewrite_marker(path, state)
        metrics.truncate_after(good_step)
        metrics.log(good_step, rollback=state["rollbacks"], rollback_from_step=failed, rollback_skipped=skipped,
                    rollback_nonfinite=int(reason == "non-finite"), rollback_loss=loss, rollback_reason=reason)
    accelerator.wait_for_everyone()
    return state


