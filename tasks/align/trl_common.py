"""The plumbing every TRL-trained method shares (DPO, GRPO, the reward model): trainer arguments
from the shared training config (their `TrlConfig` is in config.py), metrics into
metrics.jsonl, and resume from the last Trainer checkpoint."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gristmill.core.progress import PROGRESS_LINE, Reporter
from gristmill.core.stage import MetricsLog
from gristmill.core.train_config import TrainConfig
from gristmill.model.config import LoraConfig
from gristmill.model.loop import resolve_device

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

log = logging.getLogger("gristmill.align")


def trainer_args(config: TrainConfig, ckpt_dir: Path, global_batch: int) -> dict[str, Any]:
    """transformers/TRL TrainingArguments from the shared training config: AdamW with linear
    warmup and linear decay, clipping, seeds, device, checkpoints every `checkpoint_every` steps,
    and each process's share of the `global_batch` rows a step trains on. The global batch is the
    config's, so 1 or N data-parallel processes (the stage's `launch`) train on the same rows."""
    use_cpu = resolve_device(config.device).type == "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher of every rank
    if global_batch % world:
        raise ValueError(f"a batch of {global_batch} rows does not split over {world} processes; make the "
                         f"method's batch_size a multiple of {world}, or launch {world} fewer processes")
    return dict(
        per_device_train_batch_size=global_batch // world,
        output_dir=str(ckpt_dir), max_steps=config.max_steps, learning_rate=config.lr,
        lr_scheduler_type="linear", warmup_steps=config.warmup_frac, weight_decay=config.weight_decay,
        adam_beta1=config.beta1, adam_beta2=config.beta2, max_grad_norm=config.grad_clip,
        seed=config.seed, data_seed=config.seed, use_cpu=use_cpu,
        # TRL turns bf16 autocast and gradient checkpointing on by default; on CPU bf16 only adds
        # noise, and the models this stage sees on one device fit without checkpointing.
        bf16=not use_cpu and torch.cuda.is_bf16_supported(), gradient_checkpointing=False,
        save_strategy="steps", save_steps=config.checkpoint_every, save_total_limit=config.keep_checkpoints,
        logging_steps=1, report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )


def _metrics_callback(metrics: MetricsLog, prefix: str, log_every: int) -> Any:
    from transformers import TrainerCallback

    class _ToMetricsLog(TrainerCallback):
        """Each step's logged numbers (loss, rewards, margins, KL, ...) as <prefix><name> in
        metrics.jsonl, the steps on the console bar / Prefect artifact (core/progress.py) and a
        progress line every `log_every` steps; the end-of-training summary (no 'loss') is left to
        the stage stats."""

        progress: Reporter | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.progress = Reporter((prefix or "train").rstrip("/_"), unit="step",
                                     enabled=state.is_world_process_zero).start(state.max_steps, state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs or not state.is_world_process_zero:
                return
            row = {f"{prefix}{k}": float(v) for k, v in logs.items() if isinstance(v, (int, float)) and k != "epoch"}
            metrics.log(state.global_step, **row)
            if self.progress is not None:
                self.progress.advance(state.global_step - self.progress.done, loss=float(logs["loss"]))
            if state.global_step % log_every == 0 or state.global_step == state.max_steps:
                log.info("%sstep %d/%d loss %.4f", prefix, state.global_step, state.max_steps, logs["loss"],
                         extra={PROGRESS_LINE: True})

    return _ToMetricsLog()


def last_checkpoint(ckpt_dir: Path) -> tuple[str | None, int]:
    """(the newest complete Trainer checkpoint in `ckpt_dir` or None, its step or 0)."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(ckpt_dir)) if Path(ckpt_dir).is_dir() else None
    return last, int(Path(last).name.split("-")[-1]) if last else 0


def train_resumably(trainer: Any, config: TrainConfig, metrics: MetricsLog,
                    prefix: str = "") -> tuple[Any, int]:
    """Train from the last checkpoint in the trainer's output_dir if there is one; (train summary,
    resumed step). Step metrics go to metrics.jsonl as <prefix><name>, not to stdout."""
    from transformers import PrinterCallback

    resume_from, resumed_step = last_checkpoint(Path(trainer.args.output_dir))
    if trainer.is_world_process_zero():  # the one process that writes metrics.jsonl
        metrics.truncate_after(resumed_step)  # lines past the checkpoint belong to steps redone now
    if resume_from:
        log.info("resuming from %s", resume_from)
    trainer.remove_callback(PrinterCallback)
    callback = _metrics_callback(metrics, prefix, config.log_every)
    trainer.add_callback(callback)
    try:
        return trainer.train(resume_from_checkpoint=resume_from), resumed_step
    finally:
        if callback.progress is not None:  # the bar ends, and the console's log handlers come back
            callback.progress.close()


def with_lora(model: PreTrainedModel, lora: LoraConfig | None, seed: int) -> PreTrainedModel | PeftModel:
    """The model to train: itself, or wrapped with LoRA adapters (seeded) when `lora` is set."""
    if lora is None:
        return model
    from gristmill.model.lora import apply_lora

    torch.manual_seed(seed)
    return apply_lora(model, lora)
