"""Method `dpo`: direct preference optimisation on (prompt, chosen, rejected) pairs with TRL's
`DPOTrainer` against the frozen SFT model (with LoRA: the same model with its adapters off).

Pairs come from the preference sources (tasks/align/preferences.py); a seeded share is held out.
On the held-out pairs, before and after training: the implicit-reward preference accuracy and
margin (reward = beta * log(policy / reference); 0 before training by construction) and the
log-prob preference accuracy (how often the policy itself gives the chosen reply more
probability), whose "before" is the SFT model's measured value.

With `sft_weight` the NLL term is the mean over every chosen token of a step's global batch, so 1
or N data-parallel processes train the same curve (`sft_share`); TRL's own term is the mean over
a process's share of the pairs.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from gristmill.core.stage import MetricsLog
from gristmill.model.checkpoint import CHECKPOINTS_DIR
from gristmill.model.ranks import Ranks
from gristmill.tasks.align.config import DPOConfig
from gristmill.tasks.align.method import AlignJob
from gristmill.tasks.align.preferences import Pair, load_pairs, split_heldout
from gristmill.tasks.align.trl_common import train_resumably, trainer_args, with_lora

log = logging.getLogger("gristmill.align")


def to_trl_rows(pairs: list[Pair]) -> list[dict[str, Any]]:
    """TRL's conversational explicit-prompt format: TRL renders it with the tokenizer's chat template."""
    return [{"prompt": p["prompt"],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in pairs]


def count_truncated(rows: Any, max_seq_len: int) -> int:
    """Tokenized pairs whose prompt plus longer response exceeds `max_seq_len` (cut at the end)."""
    return sum(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) > max_seq_len
               for r in rows)


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
    """Implicit-reward accuracy and mean margin (reward = beta * log(policy/reference)), how often
    the policy alone gives the chosen response more probability, and by how many nats on average."""
    rewards = beta * (policy - reference)
    margins = rewards[:, 0] - rewards[:, 1]
    return {"pref_acc": (margins > 0).float().mean().item(),
            "margin": margins.mean().item(),
            "logp_acc": (policy[:, 0] > policy[:, 1]).float().mean().item(),
            "logp_margin": (policy[:, 0] - policy[:, 1]).mean().item()}


def sft_share(inputs: dict[str, torch.Tensor]) -> float:
    """This rank's factor on TRL's SFT term, which is the mean NLL over the chosen tokens of the
    rank's own pairs (its batch is [chosen..., rejected...]) while data parallelism averages the
    ranks' losses: times (its chosen tokens x ranks / every rank's chosen tokens) the average is the
    mean over every chosen token of the step's global batch, as one process computes it. 1 in one
    process."""
    mine = inputs["completion_mask"][:, 1:].chunk(2, dim=0)[0].sum()
    ranks = Ranks.of_launch(mine.device)
    if ranks.world == 1:
        return 1.0
    (everywhere,) = ranks.total(mine)
    return (mine * ranks.world / everywhere).item() if everywhere else 1.0


def _trainer_class() -> type:
    """TRL's DPOTrainer with its SFT term over the global batch (`sft_share`)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    class GlobalBatchDPOTrainer(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            weights = self.loss_weights
            if "sft" in self.loss_types:
                share = sft_share(inputs)
                self.loss_weights = [w * share if kind == "sft" else w for kind, w in zip(self.loss_types, weights)]
            try:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            finally:
                self.loss_weights = weights

    return GlobalBatchDPOTrainer


def build_trainer(config: DPOConfig, job: AlignJob, train: list[Pair], heldout: list[Pair]) -> Any:
    from datasets import Dataset
    from trl.trainer.dpo_config import DPOConfig as TrlDPOConfig  # ours is the stage section

    losses = {"sigmoid": 1.0, **({"sft": config.sft_weight} if config.sft_weight else {})}
    args = TrlDPOConfig(**trainer_args(config, job.out_dir / CHECKPOINTS_DIR, config.batch_size), beta=config.beta,
                         loss_type=list(losses), loss_weights=list(losses.values()),
                         max_length=config.max_seq_len, truncation_mode="keep_start", dataset_num_proc=None)
    # The frozen SFT model is the reference; with LoRA, TRL switches the adapters off instead.
    reference = None if job.lora else copy.deepcopy(job.model).eval().requires_grad_(False)
    return _trainer_class()(model=with_lora(job.model, job.lora, config.seed), ref_model=reference, args=args,
                          processing_class=job.tokenizer, train_dataset=Dataset.from_list(to_trl_rows(train)),
                          eval_dataset=Dataset.from_list(to_trl_rows(heldout)))


def train(config: DPOConfig, job: AlignJob) -> tuple[torch.nn.Module, dict[str, Any]]:
    pairs, drops = load_pairs(config.data, config.max_pairs, config.seed)
    train_pairs, heldout = split_heldout(pairs, config.heldout_fraction, config.seed)
    trainer = build_trainer(config, job, train_pairs, heldout)
    n_train, n_heldout = len(trainer.train_dataset), len(trainer.eval_dataset)
    drops["prompt_too_long"] = len(pairs) - n_train - n_heldout
    if not n_train or not n_heldout:
        raise ValueError(f"max_seq_len={config.max_seq_len} leaves {n_train} training and {n_heldout} "
                         f"held-out pairs of {config.data} (prompts that fill it are dropped)")

    def heldout_logps() -> torch.Tensor:
        return response_logps(trainer.model, trainer.eval_dataset, trainer.data_collator,
                              config.batch_size, trainer.accelerator.device)

    # Before training the policy is the reference (a copy, or LoRA's zero-initialised adapters):
    # its implicit rewards are 0 by definition, its log-prob accuracy is the SFT model's. A resume
    # loads trained weights only inside train().
    ref_logps = heldout_logps()
    before = preference_stats(ref_logps, ref_logps, config.beta)
    summary, resumed_step = train_resumably(trainer, config, MetricsLog(job.out_dir))
    after = preference_stats(heldout_logps(), ref_logps, config.beta)
    log.info("held-out log-prob preference accuracy %.3f -> %.3f, implicit-reward margin %.4f -> %.4f",
             before["logp_acc"], after["logp_acc"], before["margin"], after["margin"])
    return trainer.model, {
        "pairs_train": n_train, "pairs_heldout": n_heldout, "steps": trainer.state.global_step,
        "resumed_from_step": resumed_step, "train_loss": summary.training_loss,
        "truncated_too_long": count_truncated(trainer.train_dataset, config.max_seq_len),
        **{f"heldout_{k}_before": v for k, v in before.items()},
        **{f"heldout_{k}_after": v for k, v in after.items()},
        **{f"dropped_{reason}": n for reason, n in sorted(drops.items())},
    }
