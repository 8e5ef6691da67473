"""The one training loop of the training stages (pretrain, SFT, and later alignment).

Accelerate runs it on CPU, one GPU, or several processes (`accelerate launch`); AdamW with a
warmup+cosine LR, gradient clipping and optional gradient accumulation. Resume is exact: batches
come from `get_batch(step)`, a pure function of (seed, step), and the state of model, optimizer,
scheduler and RNGs is checkpointed every `checkpoint_every` steps under
`work_dir/checkpoints/step-%07d`. A checkpoint counts only once its `checkpoint.json` marker is in
place, and it is written into a temporary directory that is renamed when complete.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from pydantic import Field, model_validator

from model.schedule import warmup_cosine
from tasks.stage import MetricsLog, StageConfig

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]
EvalFn = Callable[[torch.nn.Module], dict[str, float]]

IGNORE_INDEX = -100  # label value that carries no loss (prompt tokens, padding)
MARKER = "checkpoint.json"  # written last inside a checkpoint: its completion marker
RECENT_LOSSES = 10  # steps averaged into the reported final train loss


class LoopConfig(StageConfig):
    """Optimisation and checkpointing knobs shared by every training stage config."""

    unhashed_fields: ClassVar[frozenset[str]] = frozenset(
        {"checkpoint_every", "keep_checkpoints", "log_every", "eval_every"})

    max_steps: int = Field(200, gt=0, description="Optimizer steps to train for.")
    batch_size: int = Field(8, gt=0, description="Sequences per optimizer step (across all processes).")
    grad_accum_steps: int = Field(1, gt=0, description="Micro-batches each step's batch is split into "
                                                       "(a memory knob; batch_size must divide evenly).")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate of AdamW.")
    warmup_frac: float = Field(0.1, ge=0, lt=1, description="Share of max_steps spent in linear LR warmup.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of lr (cosine floor).")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay "
                                                       "(matrices only; norms and biases get none).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient L2 norm; 0 disables clipping.")
    seed: int = Field(0, description="Seed of the initialisation and of the data order.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when available, else CPU. bf16 autocast is used on CUDA only.")
    checkpoint_every: int = Field(50, gt=0, description="Save a resumable checkpoint every N steps.")
    keep_checkpoints: int = Field(2, gt=0, description="Most recent complete checkpoints kept on disk.")
    log_every: int = Field(10, gt=0, description="Log a one-line progress summary every N steps.")
    eval_every: int = Field(50, ge=0, description="Run the stage's evaluation every N steps "
                                                   "(and always at the end); 0: only at the end.")

    @model_validator(mode="after")
    def _check_accumulation(self) -> "LoopConfig":
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by "
                             f"grad_accum_steps ({self.grad_accum_steps})")
        return self


def resolve_device(device: str) -> torch.device:
    """The torch device for a config's `device`; asking for CUDA without one is an error."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='auto' or 'cpu'")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def token_loss_sum(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropy in nats, number of labelled tokens). `labels[:, t]` is the
    target for position t (already shifted); IGNORE_INDEX positions carry no loss."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()


def causal_lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens of a batch."""
    loss, count = token_loss_sum(model, batch)
    return loss / count.clamp(min=1)


@torch.no_grad()
def mean_token_loss(model: torch.nn.Module, batches: list[Batch]) -> float:
    """Token-weighted mean loss (nats) over batches, e.g. a validation or held-out set."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        loss, n = token_loss_sum(model, {k: v.to(device) for k, v in batch.items()})
        total, count = total + loss.item(), count + int(n)
    model.train(was_training)
    return total / max(count, 1)


def make_optimizer(model: torch.nn.Module, cfg: LoopConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (embeddings and linear weights)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def complete_checkpoints(work_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with their marker) under `work_dir/checkpoints`, oldest first."""
    root = Path(work_dir) / "checkpoints"
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        marker = path / MARKER
        if path.is_dir() and marker.is_file():
            found.append((json.loads(marker.read_text())["step"], path))
    return sorted(found)


def _save_checkpoint(accelerator: Accelerator, work_dir: Path, state: dict[str, Any], keep: int) -> None:
    root = Path(work_dir) / "checkpoints"
    final = root / f"step-{state['step']:07d}"
    tmp = root / f"tmp-step-{state['step']:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / MARKER).write_text(json.dumps(state) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for _, old in complete_checkpoints(work_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def remove_checkpoints(work_dir: Path) -> None:
    """Delete all checkpoints once a stage's outputs are exported (they are several times the
    model's size and only serve a resume)."""
    shutil.rmtree(Path(work_dir) / "checkpoints", ignore_errors=True)


def _clear_partial_checkpoints(work_dir: Path) -> None:
    """Remove temporary and unmarked checkpoint directories left by a crash."""
    root = Path(work_dir) / "checkpoints"
    for path in root.glob("*") if root.is_dir() else []:
        if path.is_dir() and not (path / MARKER).is_file():
            shutil.rmtree(path)


def make_accelerator(cfg: LoopConfig) -> Accelerator:
    """An Accelerator for cfg.device: bf16 autocast on CUDA, full fp32 on CPU."""
    use_cuda = resolve_device(cfg.device).type == "cuda"
    if not torch.distributed.is_initialized():
        # Accelerate's state is a process-wide singleton; in one process, stages may ask for
        # different devices (a CPU test, then a CUDA run), so start from a clean state.
        AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(cpu=not use_cuda, mixed_precision="bf16" if use_cuda else "no")


def _shard(batch: Batch, accelerator: Accelerator) -> Batch:
    """This process's rows of the global batch."""
    rank, world = accelerator.process_index, accelerator.num_processes
    return {k: v[rank::world] for k, v in batch.items()}


def _train_step(model, optimizer, scheduler, batch: Batch, loss_fn: LossFn, cfg: LoopConfig,
                accelerator: Accelerator) -> tuple[float, float]:
    """One optimizer step over `batch`; returns (mean loss, grad norm before clipping)."""
    micro_batches = [dict(zip(batch, parts)) for parts in
                     zip(*(v.chunk(cfg.grad_accum_steps) for v in batch.values()))]
    total = torch.zeros((), device=accelerator.device)
    for i, micro in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # Gradients are only all-reduced on the last micro-batch.
        with nullcontext() if last else accelerator.no_sync(model):
            loss = loss_fn(model, {k: v.to(accelerator.device) for k, v in micro.items()})
            accelerator.backward(loss / len(micro_batches))
        total += loss.detach() / len(micro_batches)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return accelerator.reduce(total, "mean").item(), float(grad_norm)


def _tokens_in(batch: Batch) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def _resume(accelerator: Accelerator, work_dir: Path, metrics: MetricsLog, log: logging.Logger) -> dict:
    """Load the latest complete checkpoint, if any; returns its saved loop state."""
    if accelerator.is_main_process:
        _clear_partial_checkpoints(work_dir)
    accelerator.wait_for_everyone()
    done = complete_checkpoints(work_dir)
    if not done:
        if accelerator.is_main_process:
            metrics.truncate_after(-1)  # entries from a run that crashed before its first checkpoint
        return {"step": 0, "tokens_seen": 0, "recent_losses": [], "eval": {}}
    step, path = done[-1]
    log.info("resuming from step %d (%s)", step, path)
    accelerator.load_state(str(path))
    if accelerator.is_main_process:
        metrics.truncate_after(step)
    return json.loads((path / MARKER).read_text())


def _due(done: int, every: int, max_steps: int) -> bool:
    """Whether a periodic action (log, eval, checkpoint) runs after `done` steps; always at the end."""
    return done == max_steps or (every > 0 and done % every == 0)


def _prepare(model: torch.nn.Module, cfg: LoopConfig):
    """Accelerator, prepared model and optimizer, and the LR scheduler (registered for checkpoints)."""
    accelerator = make_accelerator(cfg)
    model.train()
    model, optimizer = accelerator.prepare(model, make_optimizer(model, cfg))
    # Stepped by us once per optimizer step (a prepared scheduler steps once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, cfg.max_steps, cfg.warmup_frac, cfg.min_lr_ratio))
    accelerator.register_for_checkpointing(scheduler)
    return accelerator, model, optimizer, scheduler


def train(model: torch.nn.Module, get_batch: Callable[[int], Batch], cfg: LoopConfig, work_dir: Path,
          metrics: MetricsLog, *, loss_fn: LossFn = causal_lm_loss, evaluate: EvalFn | None = None,
          log: logging.Logger | None = None) -> dict[str, Any]:
    """Train `model` in place for `cfg.max_steps` optimizer steps, resuming from the latest
    checkpoint in `work_dir`. `get_batch(step)` must return the global batch of step `step`
    (0-based) as a pure function of the step. Returns a summary: final_train_loss (mean of the
    last steps), steps, tokens_seen, tokens_per_s (this invocation), resumed_from_step, and the
    last values returned by `evaluate` (also logged every `eval_every` steps and at the end)."""
    log = log or logging.getLogger("gristmill.train")
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    accelerator, model, optimizer, scheduler = _prepare(model, cfg)
    state = _resume(accelerator, work_dir, metrics, log)
    resumed_from = state["step"]
    t0, tokens_now = time.perf_counter(), 0
    for step in range(resumed_from, cfg.max_steps):
        batch = _shard(get_batch(step), accelerator)
        lr = scheduler.get_last_lr()[0]
        loss, grad_norm = _train_step(model, optimizer, scheduler, batch, loss_fn, cfg, accelerator)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {step + 1}; lower lr or check the data")
        tokens = _tokens_in(batch) * accelerator.num_processes
        tokens_now, done = tokens_now + tokens, step + 1
        state = {**state, "step": done, "tokens_seen": state["tokens_seen"] + tokens,
                 "recent_losses": (state["recent_losses"] + [loss])[-RECENT_LOSSES:]}
        row = {"loss": loss, "lr": lr, "grad_norm": grad_norm}
        if evaluate is not None and _due(done, cfg.eval_every, cfg.max_steps):
            with accelerator.autocast():
                state["eval"] = evaluate(accelerator.unwrap_model(model))
            row.update(state["eval"])
        if accelerator.is_main_process:
            metrics.log(done, **row)
        if _due(done, cfg.log_every, cfg.max_steps):
            tok_s = tokens_now / max(time.perf_counter() - t0, 1e-9)
            log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f tok/s %.0f%s", done, cfg.max_steps, loss,
                     lr, grad_norm, tok_s, "".join(f" {k} {v:.4f}" for k, v in state["eval"].items()))
        # Metrics are logged before the checkpoint, so a resume from `done` has all rows up to it.
        if _due(done, cfg.checkpoint_every, cfg.max_steps):
            _save_checkpoint(accelerator, work_dir, state, cfg.keep_checkpoints)
    elapsed = time.perf_counter() - t0
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    recent = state["recent_losses"]
    return {"final_train_loss": sum(recent) / len(recent) if recent else float("nan"),
            "steps": state["step"], "tokens_seen": state["tokens_seen"],
            "tokens_per_s": tokens_now / elapsed if tokens_now else 0.0,
            "resumed_from_step": resumed_from, **state["eval"]}
