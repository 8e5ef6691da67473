"""Reward model for RLHF: a scalar head on the SFT model, trained Bradley–Terry style on preference
pairs, its held-out accuracy, and a scorer that PPO calls on its rollouts.

The model is `AutoModelForSequenceClassification.from_pretrained(sft_dir, num_labels=1)`: the SFT
trunk plus a freshly initialised linear head read at the last non-pad token. TRL's `RewardTrainer`
trains it on -log sigmoid(r(chosen) - r(rejected)); its Trainer checkpoints in
`out_dir/rm_checkpoints` make a killed run resume where it stopped, like the other TRL methods.stage.

Pairs are tokenized here, not by TRL, with the same function the scorer uses (the chat template of
core.chat: prompt turns + the response as an assistant turn), so the model is trained and queried
on identical token sequences. Pairs longer than `max_seq_len` are dropped rather than cut, since
the score is read at the last token: a cut response would be scored on its truncated end.

Accuracy (share of held-out pairs with r(chosen) > r(rejected); ties count as wrong) is measured
before training with the random head this run drew, as the mean over 32 freshly drawn heads (the
untrained baseline as an expectation; see untrained_head_accuracy), and after training.
"""
from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gristmill.core.chat import Message, render_with_mask
from gristmill.core.stage import MetricsLog
from gristmill.tasks.align.config import RewardModelConfig
from gristmill.tasks.align.preferences import Pair
from gristmill.tasks.align.trl_common import train_resumably, trainer_args

log = logging.getLogger("gristmill.reward_model")

RM_DIR = "reward_model"  # the exported reward model, under the caller's out_dir
RM_CHECKPOINT_DIR = "rm_checkpoints"  # Trainer checkpoints while training; removed after export
UNTRAINED_HEADS = 32  # random score heads averaged into the untrained baseline accuracy
STATS_FILE = "rm_stats.json"  # written last into RM_DIR: marks the reward model as complete


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


@torch.no_grad()
def untrained_head_accuracy(model: torch.nn.Module, rows: list[dict], pad_id: int, batch_size: int,
                            device: torch.device, heads: int = UNTRAINED_HEADS, seed: int = 0) -> float:
    """Mean held-out accuracy of `heads` freshly drawn score heads on the untrained trunk: the
    untrained baseline as an expectation over initialisations. One draw is a poor baseline: pairs
    that differ in the same way (a hedge, say) get the same sign from a random head, so a single
    head is right or wrong on all of them at once and its accuracy swings with the seed. The head
    is drawn isotropic (as HF's normal init), so only its direction matters."""
    score = model.score  # the [1, hidden] head of *ForSequenceClassification models
    if not isinstance(score, torch.nn.Linear):
        raise TypeError(f"{type(model).__name__} has no linear score head")
    head = score.weight
    saved = head.detach().clone()
    generator = torch.Generator().manual_seed(seed)
    accuracies = []
    try:
        for _ in range(heads):
            head.copy_(torch.randn(saved.shape, generator=generator).to(head) * saved.std())
            accuracies.append(_heldout_stats(model, rows, pad_id, batch_size, device)["accuracy"])
    finally:
        head.copy_(saved)
    return sum(accuracies) / len(accuracies)


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

def _build_trainer(model: Any, tokenizer: Any, rows: list[dict], config: RewardModelConfig,
                   ckpt_dir: Path) -> Any:
    from datasets import Dataset
    from trl.trainer.reward_config import RewardConfig
    from trl.trainer.reward_trainer import RewardTrainer

    args = RewardConfig(**trainer_args(config, ckpt_dir, config.batch_size),
                        center_rewards_coefficient=config.center_rewards_coef or None, max_length=None,
                        dataset_num_proc=None)
    return RewardTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=Dataset.from_list(rows))


def train_reward_model(sft_dir: Path, train_pairs: Sequence[Pair], heldout_pairs: Sequence[Pair],
                       config: RewardModelConfig, out_dir: Path,
                       metrics: MetricsLog) -> tuple[Path, dict[str, Any]]:
    """Train a reward model from the SFT model in `sft_dir` and export it to `out_dir/reward_model`.

    Resumable: a finished reward model (its stats file in place) is reused as is; otherwise
    training continues from the last checkpoint in `out_dir/rm_checkpoints`. Metrics are logged as
    `rm/<name>` at the reward trainer's steps. Returns (rm_dir, stats): rm_pairs_train/heldout,
    dropped_rm_too_long, rm_steps, rm_resumed_from_step, rm_train_loss,
    heldout_rm_accuracy_before/after, heldout_rm_accuracy_untrained_mean (the mean over random
    heads, see untrained_head_accuracy) and heldout_rm_margin_before/after."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from gristmill.model.export import export_model
    from gristmill.model.parallel import is_rank0

    out_dir, rm_dir = Path(out_dir), Path(out_dir) / RM_DIR
    if (rm_dir / STATS_FILE).is_file():
        log.info("reward model already trained: %s", rm_dir)
        return rm_dir, json.loads((rm_dir / STATS_FILE).read_text())

    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    train_rows, dropped_train = tokenize_pairs(tokenizer, train_pairs, config.max_seq_len)
    heldout_rows, dropped_heldout = tokenize_pairs(tokenizer, heldout_pairs, config.max_seq_len)
    if not train_rows or not heldout_rows:
        raise ValueError(f"max_seq_len={config.max_seq_len} leaves {len(train_rows)} training and "
                         f"{len(heldout_rows)} held-out reward-model pairs")
    torch.manual_seed(config.seed)  # the score head is initialised randomly at load
    model = AutoModelForSequenceClassification.from_pretrained(sft_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad token

    ckpt_dir = out_dir / RM_CHECKPOINT_DIR
    trainer = _build_trainer(model, tokenizer, train_rows, config, ckpt_dir)
    device, pad_id = trainer.accelerator.device, tokenizer.pad_token_id
    before = _heldout_stats(trainer.model, heldout_rows, pad_id, config.batch_size, device)
    untrained_mean = untrained_head_accuracy(trainer.model, heldout_rows, pad_id, config.batch_size, device,
                                             seed=config.seed)

    summary, resumed_step = train_resumably(trainer, config, metrics, prefix="rm/")

    after = _heldout_stats(trainer.model, heldout_rows, pad_id, config.batch_size, device)
    log.info("reward model held-out accuracy %.3f -> %.3f, margin %.3f -> %.3f",
             before["accuracy"], after["accuracy"], before["margin"], after["margin"])
    stats = {"rm_pairs_train": len(train_rows), "rm_pairs_heldout": len(heldout_rows),
             "dropped_rm_too_long": dropped_train + dropped_heldout, "rm_steps": trainer.state.global_step,
             "rm_resumed_from_step": resumed_step, "rm_train_loss": summary.training_loss,
             "heldout_rm_accuracy_before": before["accuracy"], "heldout_rm_accuracy_after": after["accuracy"],
             "heldout_rm_accuracy_untrained_mean": untrained_mean,
             "heldout_rm_margin_before": before["margin"], "heldout_rm_margin_after": after["margin"]}
    if is_rank0():  # rank 0 of a data-parallel launch; the others hold the same weights
        export_model(trainer.model, tokenizer, rm_dir)
        (rm_dir / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")  # last: marks it complete
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()  # every process loads the exported reward model next
    return rm_dir, stats
