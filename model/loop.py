"""The one training loop of the training stages (pretrain, SFT, and later alignment).

Accelerate runs it on CPU, one GPU, or several processes (`accelerate launch`, `torchrun`, Ray
Train), replicated (DDP) or sharded (FSDP2; model/parallel.py); AdamW or Muon (model/optim.py) with a
warmup+cosine or warmup-stable-decay LR, gradient clipping and gradient accumulation, bf16 on GPU
and optional per-block `torch.compile`. Each process runs `batch_size` sequences per forward pass
(the config resolved by `LoopConfig.with_seq_len`). Resume is exact: batches come from
`get_batch(index)`, a pure function of (seed, index), so the data position is the step (plus the
rollback offset), and the whole state of model, optimizer and scheduler is checkpointed every
`checkpoint_every` steps as `checkpoints/step-%07d` of the work directory, on its disk or its
artifact store's bucket (model/checkpoint.py: the marker with every file's digest written last, a
damaged checkpoint skipped on resume; model/train_state.py: what a checkpoint holds, resume and
rollback). Each checkpoint's seconds and bytes are logged in its step's row (checkpoint_s,
checkpoint_bytes) and summarised in the returned stats.

Faults: a non-finite loss or gradient norm, or a loss spike (above the rolling mean of the last
`spike_window` losses by `spike_zscore` standard deviations), rolls training back to the last
complete checkpoint and skips the batches between it and the offending one. Skipping is a
persistent offset (batch index = step + skip_offset) kept in the checkpoint marker, so a resume
after a rollback stays exact. After `max_rollbacks` rollbacks the run stops with TrainingDiverged.

Progress: the main process reports every step and its loss to a core.progress reporter (a console
bar on a terminal, the stage's Prefect progress artifact, a relay to the parent of launched ranks).
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, cast

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from gristmill.core.launch import PRECISION_VAR
from gristmill.core.progress import PROGRESS_LINE, Reporter
from gristmill.core.stage import MetricsLog
from gristmill.model.checkpoint import ROW_KEY, Place, checkpoint_stats
from gristmill.model.config import LoopConfig
from gristmill.model.optim import make_optimizer
from gristmill.model.parallel import (
    clip_grad_norm,
    compile_blocks,
    is_sharded,
    launched_world_size,
    shard,
)
from gristmill.model.schedule import lr_multiplier
from gristmill.model.throughput import Throughput, device_peak_tflops
from gristmill.model.train_state import Parts, anomaly, resume, rollback, save_state
from gristmill.model.train_state import (
    TrainingDiverged as TrainingDiverged,  # raised by rollback; callers catch it here
)

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]
EvalFn = Callable[[torch.nn.Module], dict[str, float]]

IGNORE_INDEX = -100  # label value that carries no loss (prompt tokens, padding)
LABEL_TOTAL = "label_total"  # batch column: labelled tokens in the whole global batch (with_label_totals)
RECENT_LOSSES = 10  # steps averaged into the reported final train loss


def resolve_device(device: str) -> torch.device:
    """The torch device for a config's `device`; asking for CUDA without one is an error."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='auto' or 'cpu'")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def model_inputs(batch: Batch) -> dict[str, Any]:
    """Forward arguments of a batch, without a KV cache (a training or scoring pass never reuses
    one; building it copies every layer's keys and values). A packed batch (model/packing.py)
    carries position ids that restart at each example and no attention mask; the model then keeps
    examples from attending across each other, which also needs use_cache=False."""
    if "position_ids" not in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"), "use_cache": False}
    if "attention_mask" in batch:
        raise ValueError("a packed batch must not carry an attention_mask: it would disable the "
                         "per-example masking that position_ids give")
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}


@functools.cache
def _masks_logits() -> bool:
    """Whether this transformers takes a boolean (batch, seq) mask as `logits_to_keep`; older releases
    (5.17, which GPU images carry) take positions shared by every row only."""
    from transformers import modeling_utils

    return hasattr(modeling_utils, "slice_logits_to_keep")


def token_loss_sum(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropy in nats, number of labelled tokens) of a padded or packed
    batch. `labels[:, t]` is the target for position t (already shifted); IGNORE_INDEX positions
    carry no loss."""
    labels = batch["labels"]
    scored = labels != IGNORE_INDEX
    if bool(scored.all()):  # pretraining windows: every position is a target
        logits = model(**model_inputs(batch)).logits.flatten(0, 1)
        targets = labels.flatten()
    else:
        # Project only the scored positions onto the vocabulary (transformers' `logits_to_keep`).
        # Prompt and padding positions carry no loss; in SFT on short chats they are over half the
        # rows, and the output projection and softmax over the vocabulary are about half of a tiny
        # model's work per position.
        if _masks_logits():  # a boolean mask: a flat (scored, vocab) tensor
            logits = model(**model_inputs(batch), logits_to_keep=scored).logits
            targets = labels[scored]
        else:  # positions scored in any row, then the scored ones among them
            keep = scored.any(0).nonzero().squeeze(1)
            kept = scored[:, keep]
            logits = model(**model_inputs(batch), logits_to_keep=keep).logits[kept]
            targets = labels[:, keep][kept]
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    return loss, scored.sum()


def causal_lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy over the labelled tokens of a batch, divided by LABEL_TOTAL when
    the batch carries it (the training loop adds it: this rows' share of the global batch's mean),
    else by the batch's own count (its mean)."""
    loss, count = token_loss_sum(model, batch)
    total = batch.get(LABEL_TOTAL)
    return loss / (total[0] if total is not None and len(total) else count.clamp(min=1))


def with_label_totals(batch: Batch) -> Batch:
    """`batch` (a global batch) with each labels tensor's count of labelled tokens as a per-row
    column (`<prefix>label_total`): split across processes and micro-batches, every part's loss is
    then its share of the global mean, so the step's gradient does not depend on how many tokens
    each part happens to hold, nor on how many processes there are."""
    totals = {key.removesuffix("labels") + LABEL_TOTAL:
              torch.full((len(labels),), float((labels != IGNORE_INDEX).sum().clamp(min=1)))
              for key, labels in batch.items() if key.endswith("labels")}
    return {**batch, **totals}


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


def shards(cfg: LoopConfig) -> bool:
    """Whether the model is sharded: `fsdp` asked, in a launch of several processes (one process
    has nothing to shard over)."""
    return cfg.fsdp and launched_world_size() > 1


def make_accelerator(cfg: LoopConfig) -> tuple[Accelerator, str]:
    """An Accelerator for cfg.device, and the precision to train in: the one a launcher chose
    (PRECISION_VAR: `accelerate launch` sets it from its config file or the stage's
    `launch.mixed_precision`), else bf16 on CUDA and full fp32 on CPU. A sharded model gets its
    precision from FSDP's policy (model/parallel.py), so its Accelerator adds no autocast."""
    use_cuda = resolve_device(cfg.device).type == "cuda"
    if not torch.distributed.is_initialized():
        # Accelerate's state is a process-wide singleton; in one process, stages may ask for
        # different devices (a CPU test, then a CUDA run), so start from a clean state.
        AcceleratorState._reset_state(reset_partial_state=True)
    precision = os.environ.get(PRECISION_VAR) or ("bf16" if use_cuda else "no")
    return Accelerator(cpu=not use_cuda, mixed_precision="no" if shards(cfg) else precision), precision


def _shard(batch: Batch, accelerator: Accelerator) -> Batch:
    """This process's rows of the global batch."""
    rank, world = accelerator.process_index, accelerator.num_processes
    return {k: v[rank::world] for k, v in batch.items()}


def _train_step(model, optimizer, scheduler, batch: Batch, loss_fn: LossFn, cfg: LoopConfig,
                accelerator: Accelerator) -> tuple[float, float]:
    """One optimizer step over this process's shard of the global batch; returns (the global
    batch's loss, grad norm before clipping). `loss_fn` gives each micro-batch's share of the
    global loss (with_label_totals), so the shares add up across micro-batches and processes."""
    micro_batches = [dict(zip(batch, parts)) for parts in
                     zip(*(v.chunk(cfg.grad_accum_steps) for v in batch.values()))]
    total = torch.zeros((), device=accelerator.device)
    for i, micro in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # Replicas all-reduce gradients on the last micro-batch only; shards reduce-scatter each
        # micro-batch's, which keeps only a shard of the gradients in memory (torchtitan's default).
        with nullcontext() if last or is_sharded(model) else accelerator.no_sync(model):
            loss = loss_fn(model, {k: v.to(accelerator.device) for k, v in micro.items()})
            # The all-reduce averages gradients over processes; the shares are to be summed.
            accelerator.backward(loss * accelerator.num_processes)
        total += loss.detach()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    accelerator.unscale_gradients(optimizer)  # fp16's loss scale; nothing under bf16 or fp32
    grad_norm = clip_grad_norm(model.parameters(), max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # accelerate's reduce is untyped; it returns the structure it is given, here a tensor
    return cast(torch.Tensor, accelerator.reduce(total, "sum")).item(), float(grad_norm)


def _tokens_in(batch: Batch) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def _due(done: int, every: int, max_steps: int) -> bool:
    """Whether a periodic action (log, eval, checkpoint) runs after `done` steps; always at the end."""
    return done == max_steps or (every > 0 and done % every == 0)


def _prepare(model: torch.nn.Module, cfg: LoopConfig) -> Parts:
    """Accelerator, the model replicated (DDP) or sharded (FSDP2) and optionally compiled per block,
    the optimizer, and the LR scheduler (saved with checkpoints as JSON)."""
    accelerator, precision = make_accelerator(cfg)
    model.train()
    model.to(accelerator.device)  # before the optimizer exists, so that it can be the fused one
    sharded = shards(cfg)
    if sharded:
        shard(model, precision)  # torchtitan's order: shard, then compile each block
    if cfg.compile:
        compile_blocks(model)
    optimizer = make_optimizer(model, cfg)
    if sharded:
        optimizer = accelerator.prepare(optimizer)  # the model is not Accelerate's to wrap
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    # Stepped by us once per optimizer step (a prepared scheduler steps once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, cfg.max_steps, cfg.schedule, cfg.warmup_frac, cfg.decay_frac, cfg.min_lr_ratio))
    return Parts(accelerator, model, optimizer, scheduler)


def train(model: torch.nn.Module, get_batch: Callable[[int], Batch], cfg: LoopConfig, checkpoints: Place,
          metrics: MetricsLog, *, loss_fn: LossFn = causal_lm_loss, evaluate: EvalFn | None = None,
          log: logging.Logger | None = None, flops_per_token: float | None = None) -> dict[str, Any]:
    """Train `model` in place for `cfg.max_steps` optimizer steps, resuming from the latest
    checkpoint in `checkpoints` (the work directory's place, model/checkpoint.py's `checkpoint_place`).
    `get_batch(index)` must return a global batch as a pure function of `index`; step s trains on
    index s + skip_offset (0 until a rollback skips batches). Logged every step: loss, lr,
    grad_norm; every `log_every` steps also tokens_per_s and, given
    `flops_per_token` (training FLOPs per token) and a known device peak, mfu. Returns a summary:
    final_train_loss (mean of the last steps), steps, tokens_seen, tokens_per_s and mfu (this
    invocation, wall clock), resumed_from_step, rollbacks, first_step_s (the first step of this
    invocation, compilation included), peak_memory_gib (CUDA), world_size, process_index, and the last
    values returned by `evaluate` (also logged every `eval_every` steps and at the end)."""
    log = log or logging.getLogger("gristmill.train")
    metrics.path.parent.mkdir(parents=True, exist_ok=True)
    parts = _prepare(model, cfg)
    accelerator, model, optimizer, scheduler = parts.accelerator, parts.model, parts.optimizer, parts.scheduler
    state = resume(parts, checkpoints, metrics, cfg, log)
    resumed_from = state["step"]
    if cfg.max_rollbacks and not checkpoints.complete():
        save_state(parts, checkpoints, state, cfg.keep_checkpoints, metrics)  # a rollback target
    peak_tflops = device_peak_tflops(cfg.peak_tflops, accelerator.device)
    meter = Throughput(flops_per_token, peak_tflops, accelerator.num_processes)
    t0, tokens_now, first_step_s, saves = time.perf_counter(), 0, None, []
    # The console bar / Prefect artifact / relay of the main process (core/progress.py); its line
    # every log_every steps stays in the log, and on the console when no bar replaces it.
    with Reporter("train", unit="step", enabled=accelerator.is_main_process) as progress:
        progress.start(cfg.max_steps, done=state["step"])
        while state["step"] < cfg.max_steps:
            step_start = time.perf_counter()
            batch = _shard(with_label_totals(get_batch(state["step"] + state["skip_offset"])), accelerator)
            lr = scheduler.get_last_lr()[0]
            loss, grad_norm = _train_step(model, optimizer, scheduler, batch, loss_fn, cfg, accelerator)
            reason = anomaly(loss, grad_norm, state["loss_window"], cfg)
            if reason:
                before = state["step"]
                state = rollback(parts, checkpoints, metrics, state, loss, reason, cfg, log)
                progress.advance(state["step"] - before)
                continue
            tokens = _tokens_in(batch) * accelerator.num_processes
            step_s = time.perf_counter() - step_start
            meter.add(tokens, step_s)
            first_step_s = first_step_s if first_step_s is not None else step_s  # compilation included
            tokens_now, done = tokens_now + tokens, state["step"] + 1
            state = {**state, "step": done, "tokens_seen": state["tokens_seen"] + tokens,
                     "recent_losses": (state["recent_losses"] + [loss])[-RECENT_LOSSES:],
                     "loss_window": (state["loss_window"] + [loss])[-cfg.spike_window:]}
            row = {"loss": loss, "lr": lr, "grad_norm": grad_norm}
            if _due(done, cfg.log_every, cfg.max_steps):
                row.update(meter.report())
            if evaluate is not None and _due(done, cfg.eval_every, cfg.max_steps):
                # Eager: a no-grad pass through the compiled blocks would compile them anew.
                with accelerator.autocast(), torch.compiler.set_stance("force_eager"):
                    state["eval"] = evaluate(parts.module)
                row.update(state["eval"])
            if _due(done, cfg.checkpoint_every, cfg.max_steps):
                # The step's row rides in the checkpoint (a stop before its line is written leaves
                # it to the resume) and gets the checkpoint's seconds and bytes.
                saved = save_state(parts, checkpoints, {**state, ROW_KEY: row}, cfg.keep_checkpoints, metrics)
                saves.append(saved)
                row.update(saved)
            if accelerator.is_main_process:
                metrics.log(done, **row)
            progress.advance(1, loss=loss)
            if _due(done, cfg.log_every, cfg.max_steps):
                log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f tok/s %.0f%s%s", done, cfg.max_steps, loss,
                         lr, grad_norm, row["tokens_per_s"], f" mfu {row['mfu']:.1%}" if "mfu" in row else "",
                         "".join(f" {k} {v:.4f}" for k, v in state["eval"].items()), extra={PROGRESS_LINE: True})
    elapsed = time.perf_counter() - t0
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    recent = state["recent_losses"]
    return {"final_train_loss": sum(recent) / len(recent) if recent else float("nan"),
            "steps": state["step"], "tokens_seen": state["tokens_seen"],
            **meter.with_mfu(tokens_now / elapsed if tokens_now else 0.0),
            "resumed_from_step": resumed_from, "rollbacks": state["rollbacks"], "first_step_s": first_step_s or 0.0,
            **({"peak_memory_gib": torch.cuda.max_memory_allocated(accelerator.device) / 2**30}
               if accelerator.device.type == "cuda" else {}),
            "world_size": accelerator.num_processes, "process_index": accelerator.process_index,
            **checkpoint_stats(saves), **state["eval"]}

