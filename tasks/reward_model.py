"""Reward model for RLHF: a scalar head on the SFT model, trained Bradley–Terry style on preference
pairs, its held-out accuracy, and a scorer that PPO calls on its rollouts.

The model is `AutoModelForSequenceClassification.from_pretrained(sft_dir, num_labels=1)`: the SFT
trunk plus a freshly initialised linear head read at the last non-pad token. TRL's `RewardTrainer`
trains it on -log sigmoid(r(chosen) - r(rejected)); its Trainer checkpoints in
`out_dir/rm_checkpoints` make a killed run resume where it stopped, like DPO in tasks.align.

Pairs are tokenized here, not by TRL, with the same function the scorer uses (the chat template of
tasks.chat: prompt turns + the response as an assistant turn), so the model is trained and queried
on identical token sequences. Pairs longer than `max_seq_len` are dropped rather than cut, since
the score is read at the last token: a cut response would be scored on its truncated end.

Accuracy (share of held-out pairs with r(chosen) > r(rejected); ties count as wrong) is measured
before training, where the random head makes it a coin flip, and after.
"""
from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from tasks.chat import Message, render_with_mask
from tasks.preferences import Pair
from tasks.stage import MetricsLog, StageConfig

log = logging.getLogger("gristmill.reward_model")

RM_DIR = "reward_model"  # the exported reward model, under the caller's out_dir
RM_CHECKPOINT_DIR = "rm_checkpoints"  # Trainer checkpoints while training; removed after export
STATS_FILE = "rm_stats.json"  # written last into RM_DIR: marks the reward model as complete


class RewardModelSettings(StageConfig):
    """How the reward model is trained."""

    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate (linear decay after warmup).")
    max_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    batch_size: int = Field(8, ge=1, description="Preference pairs per optimizer step.")
    max_seq_len: int = Field(256, ge=8, description=(
        "Most tokens of a prompt+response sequence; pairs with a longer side are dropped "
        "(counted as dropped_rm_too_long)."))
    warmup_frac: float = Field(0.1, ge=0, lt=1, description="Share of max_steps spent warming the LR up from 0.")
    center_rewards_coef: float = Field(0.01, ge=0, description=(
        "Weight of the mean squared reward added to the loss, which keeps scores centred on 0 "
        "(Eisenstein et al. 2023) so PPO's kl_coef means the same across runs; 0 disables."))
    seed: int = Field(0, description="Seed of the score head's initialisation and the data order.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' uses CUDA when available.")
    checkpoint_every: int = Field(50, ge=1, description="Steps between resumable checkpoints.")
    log_every_steps: int = Field(1, ge=1, description="Steps between metric lines in metrics.jsonl.")

    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"checkpoint_every", "log_every_steps"})


# ---------------------------------------------------------------- tokens and scores

def sequence_ids(tokenizer: Any, prompt: Sequence[Message], response: str) -> list[int]:
    """Token ids of the prompt turns followed by `response` as a closed assistant turn."""
    return render_with_mask(tokenizer, [*prompt, {"role": "assistant", "content": response}])[0]


def tokenize_pairs(tokenizer: Any, pairs: Sequence[Pair], max_seq_len: int) -> tuple[list[dict], int]:
    """Rows {"chosen_ids", "rejected_ids"} (TRL's pre-tokenized preference format) and how many
    pairs were dropped because a side is longer than `max_seq_len` tokens."""
    rows = []
    for pair in pairs:
        chosen = sequence_ids(tokenizer, pair["prompt"], pair["chosen"])
        rejected = sequence_ids(tokenizer, pair["prompt"], pair["rejected"])
        if max(len(chosen), len(rejected)) <= max_seq_len:
            rows.append({"chosen_ids": chosen, "rejected_ids": rejected})
    return rows, len(pairs) - len(rows)


@torch.no_grad()
def score_ids(model: torch.nn.Module, sequences: Sequence[list[int]], pad_id: int, batch_size: int,
              device: torch.device) -> torch.Tensor:
    """Scalar scores of token sequences, shape [n], float32 on the CPU. Sequences are right-padded;
    the classification head reads the last non-pad token (config.pad_token_id must be set)."""
    was_training = model.training
    model.eval()
    scores = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(chunk):
            ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        scores.append(logits[:, 0].float().cpu())
    model.train(was_training)
    return torch.cat(scores) if scores else torch.zeros(0)


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """Preference accuracy (strict: a tie is wrong) and mean score margin of scored pairs."""
    return {"accuracy": (chosen > rejected).float().mean().item(),
            "margin": (chosen - rejected).mean().item()}


def _heldout_stats(model: torch.nn.Module, rows: list[dict], pad_id: int, batch_size: int,
                   device: torch.device) -> dict[str, float]:
    chosen = score_ids(model, [r["chosen_ids"] for r in rows], pad_id, batch_size, device)
    rejected = score_ids(model, [r["rejected_ids"] for r in rows], pad_id, batch_size, device)
    return pair_stats(chosen, rejected)


class RewardScorer:
    """A trained reward model as a function of (prompts, responses): usable as PPO's reward_fn."""

    def __init__(self, rm_dir: Path, device: str | torch.device = "cpu", batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(rm_dir)
        self.device, self.batch_size = torch.device(device), batch_size
        self.model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
        self.model.to(self.device).eval().requires_grad_(False)
        if self.model.config.pad_token_id is None:
            raise ValueError(f"{rm_dir}: config.pad_token_id is unset; the score head cannot find the last token")

    def score(self, prompts: Sequence[Sequence[Message]], responses: Sequence[str]) -> torch.Tensor:
        """Scores of each response to its prompt, shape [n], float32 on the CPU."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        sequences = [sequence_ids(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        return score_ids(self.model, sequences, self.model.config.pad_token_id, self.batch_size, self.device)

    __call__ = score


# ---------------------------------------------------------------- training

def _metrics_callback(metrics: MetricsLog) -> Any:
    from transformers import TrainerCallback

    class _ToMetricsLog(TrainerCallback):
        """Each logged training step's numbers (loss, accuracy, margin, ...) as rm/<name> in
        metrics.jsonl; the prefix keeps them apart from the policy trainer's metrics."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                metrics.log(state.global_step, **{f"rm/{k}": float(v) for k, v in logs.items()
                                                  if isinstance(v, (int, float)) and k != "epoch"})

    return _ToMetricsLog()


def _build_trainer(model: Any, tokenizer: Any, rows: list[dict], settings: RewardModelSettings,
                   ckpt_dir: Path, use_cpu: bool) -> Any:
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(
        output_dir=str(ckpt_dir), max_steps=settings.max_steps, per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.lr, lr_scheduler_type="linear", warmup_steps=settings.warmup_frac,
        center_rewards_coefficient=settings.center_rewards_coef or None, max_length=None,
        seed=settings.seed, data_seed=settings.seed, use_cpu=use_cpu,
        # As for DPO in tasks.align: bf16 only on a GPU that has it, no gradient checkpointing.
        bf16=not use_cpu and torch.cuda.is_bf16_supported(), gradient_checkpointing=False,
        save_strategy="steps", save_steps=settings.checkpoint_every, save_total_limit=2,
        logging_steps=settings.log_every_steps, report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, dataset_num_proc=None,
    )
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer,
                            train_dataset=Dataset.from_list(rows))
    trainer.remove_callback(PrinterCallback)  # step metrics go to metrics.jsonl instead of stdout
    return trainer


def _last_checkpoint(ckpt_dir: Path) -> tuple[str | None, int]:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    return last, int(Path(last).name.split("-")[-1]) if last else 0


def train_reward_model(sft_dir: Path, train_pairs: Sequence[Pair], heldout_pairs: Sequence[Pair],
                       settings: RewardModelSettings, out_dir: Path,
                       metrics: MetricsLog) -> tuple[Path, dict[str, Any]]:
    """Train a reward model from the SFT model in `sft_dir` and export it to `out_dir/reward_model`.

    Resumable: a finished reward model (its stats file in place) is reused as is; otherwise
    training continues from the last checkpoint in `out_dir/rm_checkpoints`. Metrics are logged as
    `rm/<name>` at the reward trainer's steps. Returns (rm_dir, stats): rm_pairs_train/heldout,
    dropped_rm_too_long, rm_steps, rm_resumed_from_step, rm_train_loss,
    heldout_rm_accuracy_before/after and heldout_rm_margin_before/after."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from model.export import export_model
    from model.loop import resolve_device

    out_dir, rm_dir = Path(out_dir), Path(out_dir) / RM_DIR
    if (rm_dir / STATS_FILE).is_file():
        log.info("reward model already trained: %s", rm_dir)
        return rm_dir, json.loads((rm_dir / STATS_FILE).read_text())

    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    train_rows, dropped_train = tokenize_pairs(tokenizer, train_pairs, settings.max_seq_len)
    heldout_rows, dropped_heldout = tokenize_pairs(tokenizer, heldout_pairs, settings.max_seq_len)
    if not train_rows or not heldout_rows:
        raise ValueError(f"max_seq_len={settings.max_seq_len} leaves {len(train_rows)} training and "
                         f"{len(heldout_rows)} held-out reward-model pairs")
    torch.manual_seed(settings.seed)  # the score head is initialised randomly at load
    model = AutoModelForSequenceClassification.from_pretrained(sft_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad token

    ckpt_dir = out_dir / RM_CHECKPOINT_DIR
    use_cpu = resolve_device(settings.device).type == "cpu"
    trainer = _build_trainer(model, tokenizer, train_rows, settings, ckpt_dir, use_cpu)
    device, pad_id = trainer.accelerator.device, tokenizer.pad_token_id
    before = _heldout_stats(trainer.model, heldout_rows, pad_id, settings.batch_size, device)

    resume_from, resumed_step = _last_checkpoint(ckpt_dir)
    metrics.truncate_after(resumed_step)  # lines past the checkpoint belong to steps redone now
    trainer.add_callback(_metrics_callback(metrics))
    summary = trainer.train(resume_from_checkpoint=resume_from)

    after = _heldout_stats(trainer.model, heldout_rows, pad_id, settings.batch_size, device)
    log.info("reward model held-out accuracy %.3f -> %.3f, margin %.3f -> %.3f",
             before["accuracy"], after["accuracy"], before["margin"], after["margin"])
    stats = {"rm_pairs_train": len(train_rows), "rm_pairs_heldout": len(heldout_rows),
             "dropped_rm_too_long": dropped_train + dropped_heldout, "rm_steps": trainer.state.global_step,
             "rm_resumed_from_step": resumed_step, "rm_train_loss": summary.training_loss,
             "heldout_rm_accuracy_before": before["accuracy"], "heldout_rm_accuracy_after": after["accuracy"],
             "heldout_rm_margin_before": before["margin"], "heldout_rm_margin_after": after["margin"]}
    export_model(trainer.model, tokenizer, rm_dir)
    (rm_dir / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")  # last: marks it complete
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return rm_dir, stats
