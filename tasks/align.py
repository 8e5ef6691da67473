"""Align stage: preference-tune the SFT model (DPO for now) and export it as `model/`.

Reads `inputs["sft"].path / "model"` (HF model dir with the chat-template tokenizer), loads
preference pairs (tasks.preferences), keeps a seeded held-out share, and trains with TRL's
`DPOTrainer` against a frozen copy of the SFT model. Checkpoints live in `out_dir/checkpoints`, so
calling `run` again on the same `out_dir` after a crash resumes from the last one; they are deleted
once the model is exported. Held-out preference accuracy and implicit-reward margin are measured
before and after training.

`method` selects the trainer; a new method (ppo, grpo) adds an entry to `TRAINERS` and its own
config fields, and reuses the data loading, held-out split, evaluation and export here.
"""
from __future__ import annotations

import copy
import logging
import random
import shutil
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Mapping

import torch
from pydantic import Field, field_validator

from tasks.preferences import DEMO_PREFIX, Pair, load_preference_pairs
from tasks.stage import Engine, Manifest, MetricsLog, StageConfig, StageResult, data_fingerprint

VERSION = 1
log = logging.getLogger("gristmill.align")

CHECKPOINT_DIR = "checkpoints"


class Config(StageConfig):
    method: Literal["dpo"] = Field("dpo", description="Alignment algorithm (only 'dpo' so far).")
    data: list[str] = Field(["demo:arithmetic"], description=(
        "Preference sources: 'demo:arithmetic' or JSONL(.gz) paths in prompt/chosen/rejected, "
        "hh-rlhf or AlpacaEval-annotation format (see tasks.preferences)."))
    max_pairs: int | None = Field(None, ge=1, description=(
        "At most this many usable pairs from each source (None: all; demo: 256)."))
    beta: float = Field(0.1, gt=0, description="DPO beta: strength of the pull towards the reference model.")
    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate (linear decay after warmup).")
    max_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    batch_size: int = Field(8, ge=1, description="Preference pairs per optimizer step.")
    max_seq_len: int = Field(256, ge=8, description=(
        "Tokens per prompt+response sequence; longer ones are cut at the end, pairs whose prompt "
        "alone fills it are dropped."))
    warmup_frac: float = Field(0.1, ge=0, lt=1, description="Share of max_steps spent warming the LR up from 0.")
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description=(
        "Share of the pairs held out of training to measure preference accuracy and margin."))
    seed: int = Field(0, description="Seed for the demo data, held-out split, data order and init.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' uses CUDA when available.")
    checkpoint_every: int = Field(50, ge=1, description="Steps between resumable checkpoints in out_dir.")
    log_every_steps: int = Field(1, ge=1, description="Steps between metric lines in metrics.jsonl.")

    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"checkpoint_every", "log_every_steps"})

    @field_validator("data")
    @classmethod
    def _data_not_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("data must name at least one preference source")
        return value


def fingerprint(config: Config) -> str:
    """Digest of the preference files `config.data` points at."""
    return data_fingerprint(config.data, DEMO_PREFIX)


# ---------------------------------------------------------------- data

def load_pairs(config: Config) -> tuple[list[Pair], dict[str, int]]:
    """All sources' pairs, and dropped-record counts summed per reason."""
    pairs: list[Pair] = []
    drops: dict[str, int] = {}
    for source in config.data:
        got, dropped = load_preference_pairs(source, config.max_pairs, seed=config.seed)
        log.info("%s: %d pairs, dropped %s", source, len(got), dropped or "none")
        pairs += got
        for reason, n in dropped.items():
            drops[reason] = drops.get(reason, 0) + n
    return pairs, drops


def split_heldout(pairs: list[Pair], fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, heldout): a seeded shuffle, at least one pair on each side."""
    n_heldout = max(1, round(len(pairs) * fraction))
    if len(pairs) - n_heldout < 1:
        raise ValueError(f"heldout_fraction={fraction} leaves no training pair out of {len(pairs)}")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    return [pairs[i] for i in order[n_heldout:]], [pairs[i] for i in order[:n_heldout]]


def to_trl_rows(pairs: list[Pair]) -> list[dict[str, Any]]:
    """TRL's conversational explicit-prompt format: TRL renders it with the tokenizer's chat template."""
    return [{"prompt": p["prompt"],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in pairs]


# ---------------------------------------------------------------- held-out evaluation

@torch.no_grad()
def response_logps(model: torch.nn.Module, rows: Any, collate: Callable, batch_size: int,
                   device: torch.device) -> torch.Tensor:
    """Summed log-probs (nats) of the chosen and rejected responses, shape [pairs, 2]. `rows` are
    tokenized pairs and `collate` the trainer's collator, so truncation matches training."""
    model.eval()
    out = []
    for start in range(0, len(rows), batch_size):
        batch = collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
        ids = batch["input_ids"].to(device)
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"].to(device)).logits
        token_logps = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        seq_logps = (token_logps * batch["completion_mask"][:, 1:].to(device)).sum(-1)
        out.append(torch.stack(seq_logps.chunk(2), dim=1).cpu())  # batch is [chosen..., rejected...]
    return torch.cat(out)


def preference_stats(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> dict[str, float]:
    """Implicit-reward accuracy and mean margin (reward = beta * log(policy/reference)), and how
    often the policy alone gives the chosen response more probability."""
    rewards = beta * (policy - reference)
    margins = rewards[:, 0] - rewards[:, 1]
    return {"pref_acc": (margins > 0).float().mean().item(),
            "margin": margins.mean().item(),
            "logp_acc": (policy[:, 0] > policy[:, 1]).float().mean().item()}


# ---------------------------------------------------------------- training

def _metrics_callback(metrics: MetricsLog) -> Any:
    from transformers import TrainerCallback

    class _ToMetricsLog(TrainerCallback):
        """Copies each step's logged numbers (loss, rewards/margins, rewards/accuracies, ...) to
        metrics.jsonl; the end-of-training summary (no 'loss') is left to the stage stats."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                metrics.log(state.global_step, **{k: float(v) for k, v in logs.items()
                                                  if isinstance(v, (int, float)) and k != "epoch"})

    return _ToMetricsLog()


def _last_checkpoint(ckpt_dir: Path) -> tuple[str | None, int]:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    return last, int(Path(last).name.split("-")[-1]) if last else 0


def build_dpo_trainer(config: Config, model: Any, tokenizer: Any, train: list[Pair],
                      heldout: list[Pair], ckpt_dir: Path, use_cpu: bool) -> Any:
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    reference = copy.deepcopy(model).eval().requires_grad_(False)  # frozen SFT model
    args = DPOConfig(
        output_dir=str(ckpt_dir), max_steps=config.max_steps, per_device_train_batch_size=config.batch_size,
        learning_rate=config.lr, lr_scheduler_type="linear", warmup_steps=config.warmup_frac,
        beta=config.beta, loss_type=["sigmoid"], max_length=config.max_seq_len, truncation_mode="keep_start",
        seed=config.seed, data_seed=config.seed, use_cpu=use_cpu,
        # TRL turns bf16 autocast and gradient checkpointing on by default; on CPU bf16 only adds
        # noise, and the models this stage sees on one device fit without checkpointing.
        bf16=not use_cpu and torch.cuda.is_bf16_supported(), gradient_checkpointing=False,
        save_strategy="steps", save_steps=config.checkpoint_every, save_total_limit=2,
        logging_steps=config.log_every_steps, report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, dataset_num_proc=None,
    )
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(to_trl_rows(train)),
                         eval_dataset=Dataset.from_list(to_trl_rows(heldout)))
    # Step metrics go to metrics.jsonl (and MLflow); without tqdm the Trainer would also print
    # every step's dict to stdout.
    trainer.remove_callback(PrinterCallback)
    return trainer


def train_resumably(trainer: Any, out_dir: Path, ckpt_dir: Path) -> tuple[Any, int]:
    """Train from the last checkpoint in `ckpt_dir` if there is one; (train summary, resumed step)."""
    metrics = MetricsLog(out_dir)
    resume_from, resumed_step = _last_checkpoint(ckpt_dir)
    metrics.truncate_after(resumed_step)  # lines past the checkpoint belong to steps redone now
    if resume_from:
        log.info("resuming from %s", resume_from)
    trainer.add_callback(_metrics_callback(metrics))
    return trainer.train(resume_from_checkpoint=resume_from), resumed_step


# method -> builder of a transformers Trainer exposing `.ref_model`, `.eval_dataset`, `.data_collator`
TRAINERS: dict[str, Callable[..., Any]] = {"dpo": build_dpo_trainer}


def _heldout_logps(trainer: Any, model: torch.nn.Module, batch_size: int) -> torch.Tensor:
    return response_logps(model, trainer.eval_dataset, trainer.data_collator, batch_size,
                          trainer.accelerator.device)


def run(config: Config, inputs: Mapping[str, Manifest], out_dir: Path, *, engine: Engine) -> StageResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.export import export_model
    from model.loop import resolve_device

    out_dir, sft_dir = Path(out_dir), Path(inputs["sft"].path) / "model"
    use_cpu = resolve_device(config.device).type == "cpu"
    log.info("aligning %s with %s on %s", sft_dir, config.method, "cpu" if use_cpu else "cuda")

    pairs, drops = load_pairs(config)
    train, heldout = split_heldout(pairs, config.heldout_fraction, config.seed)
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    model = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32)
    ckpt_dir = out_dir / CHECKPOINT_DIR
    trainer = TRAINERS[config.method](config, model, tokenizer, train, heldout, ckpt_dir, use_cpu)
    drops["prompt_too_long"] = len(pairs) - len(trainer.train_dataset) - len(trainer.eval_dataset)
    if not len(trainer.train_dataset) or not len(trainer.eval_dataset):
        raise ValueError(f"max_seq_len={config.max_seq_len} leaves {len(trainer.train_dataset)} training and "
                         f"{len(trainer.eval_dataset)} held-out pairs (prompts that fill it are dropped)")

    # Before training the policy is the reference, so its implicit rewards are 0 by definition.
    ref_logps = _heldout_logps(trainer, trainer.ref_model, config.batch_size)
    before = preference_stats(ref_logps, ref_logps, config.beta)

    summary, resumed_step = train_resumably(trainer, out_dir, ckpt_dir)

    after = preference_stats(_heldout_logps(trainer, trainer.model, config.batch_size), ref_logps, config.beta)
    export_model(trainer.model, tokenizer, out_dir / "model")
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # the committed artifact is the exported model
    log.info("held-out preference accuracy %.3f -> %.3f, margin %.4f -> %.4f",
             before["pref_acc"], after["pref_acc"], before["margin"], after["margin"])
    stats: dict[str, Any] = {
        "method": config.method, "pairs_train": len(trainer.train_dataset),
        "pairs_heldout": len(trainer.eval_dataset), "steps": trainer.state.global_step,
        "resumed_from_step": resumed_step, "train_loss": summary.training_loss,
        **{f"heldout_{k}_before": v for k, v in before.items()},
        **{f"heldout_{k}_after": v for k, v in after.items()},
        **{f"dropped_{reason}": n for reason, n in sorted(drops.items())},
    }
    return StageResult(stats=stats, artifacts=["metrics.jsonl"])
