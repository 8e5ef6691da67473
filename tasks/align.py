"""Align stage: tune the SFT model with DPO, GRPO or PPO (RLHF) and export it as `model/`.

Reads `inputs["sft"].path / "model"` (HF model dir with the chat-template tokenizer). `method`
picks the algorithm from `METHODS`; each method has its own settings section (`dpo:`, `grpo:`, `ppo:`)
and shares the optimisation knobs, resume, metrics and export here:

- dpo: preference pairs (tasks.preferences), a seeded held-out share, TRL's `DPOTrainer` against
  the frozen SFT model; held-out preference accuracy and implicit-reward margin before and after;
- grpo: math prompts with reference answers and verifiable rewards (tasks.rewards), TRL's
  `GRPOTrainer` (tasks.align_grpo); held-out greedy accuracy before and after;
- ppo: a Bradley-Terry reward model on preference pairs, then our PPO against it with a KL
  penalty to the SFT model (tasks.align_ppo, model/ppo.py); held-out reward-model accuracy and
  the held-out reward-model score of greedy responses before and after.

With `lora:` set, only low-rank adapters train (model/lora.py); the reference is the same model
with its adapters switched off, and the export merges them (`adapter/` keeps them alone).
Checkpoints live in `out_dir/checkpoints`, so calling `run` again on the same `out_dir` after a
crash resumes from the last one; they are deleted once the model is exported.

A new method adds a settings class (with `sources()`: the data files it reads), a `Config` field
named after the method, and a `METHODS` entry `(config, model, tokenizer, out_dir, use_cpu) ->
(trained model, stats)`; only the chosen method's section is hashed.
"""
from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Mapping

import torch
from pydantic import Field, field_validator

from model.lora import LoraSettings
from model.ppo import PPOSettings
from tasks.reward_model import RewardModelSettings
from tasks.preferences import DEMO_PREFIX, Pair, load_preference_pairs
from tasks.stage import Engine, Manifest, MetricsLog, StageConfig, StageResult, data_fingerprint

VERSION = 2
log = logging.getLogger("gristmill.align")

CHECKPOINT_DIR = "checkpoints"


class DPOSettings(StageConfig):
    """Direct preference optimisation on (prompt, chosen, rejected) pairs."""

    data: list[str] = Field(["demo:arithmetic"], description=(
        "Preference sources: 'demo:arithmetic' or JSONL(.gz) paths in prompt/chosen/rejected, "
        "hh-rlhf or AlpacaEval-annotation format (see tasks.preferences)."))
    max_pairs: int | None = Field(None, ge=1, description=(
        "At most this many usable pairs from each source (None: all; demo: 256)."))
    beta: float = Field(0.1, gt=0, description="DPO beta: strength of the pull towards the reference model.")
    sft_weight: float = Field(0.0, ge=0, description=(
        "Weight of an added NLL loss on the chosen responses (RPO). DPO alone can lower a rejected "
        "reply by garbling the tokens after the point where it departs from the chosen one; this "
        "keeps the chosen replies likely. 0: plain DPO."))
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description=(
        "Share of the pairs held out of training to measure preference accuracy and margin."))

    @field_validator("data")
    @classmethod
    def _data_not_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("data must name at least one preference source")
        return value

    def sources(self) -> list[str]:
        return self.data


class GRPOSettings(StageConfig):
    """Group relative policy optimisation with verifiable rewards (tasks.rewards)."""

    prompts: list[str] = Field(["demo:arithmetic"], min_length=1, description=(
        "Prompt sources with reference answers: 'demo:arithmetic' or JSONL(.gz) math word problems "
        "(SVAMP context/answer, GSM8K question/answer, question|prompt + answer; see tasks.rewards)."))
    max_prompts: int | None = Field(None, ge=1, description="At most this many training prompts (None: all).")
    heldout_prompts: int = Field(64, ge=1, description=(
        "Held-out prompts (those hashing into the test bucket, tasks.arithmetic.split_of) whose "
        "greedy accuracy is measured before and after training."))
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt: the group whose "
                                                      "mean reward is each completion's baseline.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the training completions.")
    max_completion_len: int = Field(16, ge=1, description="Tokens generated per completion at most.")
    kl_beta: float = Field(0.0, ge=0, description=(
        "Weight of the per-token KL penalty to the reference (SFT) model; 0 skips the reference."))
    format_weight: float = Field(0.1, ge=0, description=(
        "Weight of the format reward (ends with the answer sentence) beside the numeric match (weight 1)."))
    scale_rewards: Literal["group", "batch", "none"] = Field("batch", description=(
        "Advantage = reward - group mean, divided by the std of its group, of the whole batch, or "
        "nothing. 'group' blows a small format difference within an all-wrong group up to the "
        "size of a right answer, rewarding wrong answers; 'batch' keeps the rewards' proportions."))

    def sources(self) -> list[str]:
        return self.prompts


class PPOMethodSettings(StageConfig):
    """RLHF: a reward model trained on preference pairs, then PPO against it (tasks.align_ppo).
    Both models carry their own optimisation settings (`reward_model`, `policy`); the stage's
    lr, max_steps and batch_size are not used by this method."""

    data: list[str] = Field(["demo:arithmetic"], min_length=1, description=(
        "Preference sources for the reward model (formats as dpo.data); their prompts are PPO's prompts."))
    max_pairs: int | None = Field(None, ge=1, description="At most this many usable pairs per source.")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description=(
        "Share of the pairs held out: reward-model accuracy and the policy's held-out score."))
    reward_model: RewardModelSettings = Field(default_factory=RewardModelSettings,
                                              description="Reward-model training (Bradley-Terry).")
    policy: PPOSettings = Field(default_factory=PPOSettings, description="PPO rollouts and updates.")

    def sources(self) -> list[str]:
        return self.data


class Config(StageConfig):
    method: Literal["dpo", "grpo", "ppo"] = Field("dpo", description="Alignment algorithm; its settings are the "
                                                              "section of the same name.")
    dpo: DPOSettings = Field(default_factory=DPOSettings, description="Settings of method 'dpo'.")
    grpo: GRPOSettings = Field(default_factory=GRPOSettings, description="Settings of method 'grpo'.")
    ppo: PPOMethodSettings = Field(default_factory=PPOMethodSettings, description="Settings of method 'ppo'.")
    lora: LoraSettings | None = Field(None, description="Train LoRA adapters on the frozen SFT model "
                                                        "(None: full fine-tuning). The export merges them.")
    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate (linear decay after warmup).")
    max_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    batch_size: int = Field(8, ge=1, description=(
        "Per optimizer step: preference pairs (dpo) or prompts, each sampled num_generations times (grpo)."))
    max_seq_len: int = Field(256, ge=8, description=(
        "Tokens per prompt+response sequence; longer ones are cut at the end (counted), examples "
        "whose prompt alone leaves no room for a response are dropped."))
    warmup_frac: float = Field(0.1, ge=0, lt=1, description="Share of max_steps spent warming the LR up from 0.")
    seed: int = Field(0, description="Seed for the demo data, held-out split, data order, sampling and init.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' uses CUDA when available.")
    checkpoint_every: int = Field(50, ge=1, description="Steps between resumable checkpoints in out_dir.")
    log_every_steps: int = Field(1, ge=1, description="Steps between metric lines in metrics.jsonl.")

    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"checkpoint_every", "log_every_steps"})

    def hashed_dict(self) -> dict[str, Any]:
        """Only the chosen method's settings section changes the output."""
        data = super().hashed_dict()
        for method in METHODS.keys() - {self.method}:
            data.pop(method, None)
        return data


def fingerprint(config: Config) -> str:
    """Digest of the data files the chosen method reads (its settings' `sources()`)."""
    return data_fingerprint(getattr(config, config.method).sources(), DEMO_PREFIX)


# ---------------------------------------------------------------- shared trainer plumbing

def trainer_args(config: Config, ckpt_dir: Path, use_cpu: bool) -> dict[str, Any]:
    """TRL/transformers TrainingArguments common to every method."""
    return dict(
        output_dir=str(ckpt_dir), max_steps=config.max_steps, learning_rate=config.lr,
        lr_scheduler_type="linear", warmup_steps=config.warmup_frac,
        seed=config.seed, data_seed=config.seed, use_cpu=use_cpu,
        # TRL turns bf16 autocast and gradient checkpointing on by default; on CPU bf16 only adds
        # noise, and the models this stage sees on one device fit without checkpointing.
        bf16=not use_cpu and torch.cuda.is_bf16_supported(), gradient_checkpointing=False,
        save_strategy="steps", save_steps=config.checkpoint_every, save_total_limit=2,
        logging_steps=config.log_every_steps, report_to="none", disable_tqdm=True,
        dataloader_num_workers=0,
    )


def _metrics_callback(metrics: MetricsLog) -> Any:
    from transformers import TrainerCallback

    class _ToMetricsLog(TrainerCallback):
        """Copies each step's logged numbers (loss, rewards, margins, KL, ...) to metrics.jsonl;
        the end-of-training summary (no 'loss') is left to the stage stats."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                metrics.log(state.global_step, **{k: float(v) for k, v in logs.items()
                                                  if isinstance(v, (int, float)) and k != "epoch"})

    return _ToMetricsLog()


def _last_checkpoint(ckpt_dir: Path) -> tuple[str | None, int]:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    return last, int(Path(last).name.split("-")[-1]) if last else 0


def train_resumably(trainer: Any, out_dir: Path) -> tuple[Any, int]:
    """Train from the last checkpoint in `out_dir/checkpoints` if there is one; (train summary,
    resumed step). Step metrics go to metrics.jsonl, not to stdout."""
    from transformers import PrinterCallback

    metrics = MetricsLog(out_dir)
    resume_from, resumed_step = _last_checkpoint(out_dir / CHECKPOINT_DIR)
    metrics.truncate_after(resumed_step)  # lines past the checkpoint belong to steps redone now
    if resume_from:
        log.info("resuming from %s", resume_from)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_metrics_callback(metrics))
    return trainer.train(resume_from_checkpoint=resume_from), resumed_step


def prepare_model(config: Config, model: torch.nn.Module) -> torch.nn.Module:
    """The model to train: itself, or wrapped with LoRA adapters (seeded) when `lora` is set."""
    if config.lora is None:
        return model
    from model.lora import apply_lora

    torch.manual_seed(config.seed)
    return apply_lora(model, config.lora)


# ---------------------------------------------------------------- dpo: data

def load_pairs(sources: list[str], max_pairs: int | None, seed: int) -> tuple[list[Pair], dict[str, int]]:
    """All sources' pairs, and dropped-record counts summed per reason."""
    pairs: list[Pair] = []
    drops: dict[str, int] = {}
    for source in sources:
        got, dropped = load_preference_pairs(source, max_pairs, seed=seed)
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


def count_truncated(rows: Any, max_seq_len: int) -> int:
    """Tokenized pairs whose prompt plus longer response exceeds `max_seq_len` (cut at the end)."""
    return sum(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) > max_seq_len
               for r in rows)


# ---------------------------------------------------------------- dpo: held-out evaluation

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


# ---------------------------------------------------------------- dpo: training

def build_dpo_trainer(config: Config, model: Any, tokenizer: Any, train: list[Pair],
                      heldout: list[Pair], out_dir: Path, use_cpu: bool) -> Any:
    import copy

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    losses = {"sigmoid": 1.0, **({"sft": config.dpo.sft_weight} if config.dpo.sft_weight else {})}
    args = DPOConfig(**trainer_args(config, out_dir / CHECKPOINT_DIR, use_cpu),
                     per_device_train_batch_size=config.batch_size, beta=config.dpo.beta,
                     loss_type=list(losses), loss_weights=list(losses.values()),
                     max_length=config.max_seq_len, truncation_mode="keep_start", dataset_num_proc=None)
    # The frozen SFT model is the reference; with LoRA, TRL switches the adapters off instead.
    reference = None if config.lora else copy.deepcopy(model).eval().requires_grad_(False)
    return DPOTrainer(model=prepare_model(config, model), ref_model=reference, args=args,
                      processing_class=tokenizer, train_dataset=Dataset.from_list(to_trl_rows(train)),
                      eval_dataset=Dataset.from_list(to_trl_rows(heldout)))


def run_dpo(config: Config, model: Any, tokenizer: Any, out_dir: Path,
            use_cpu: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    pairs, drops = load_pairs(config.dpo.data, config.dpo.max_pairs, config.seed)
    train, heldout = split_heldout(pairs, config.dpo.heldout_fraction, config.seed)
    trainer = build_dpo_trainer(config, model, tokenizer, train, heldout, out_dir, use_cpu)
    n_train, n_heldout = len(trainer.train_dataset), len(trainer.eval_dataset)
    drops["prompt_too_long"] = len(pairs) - n_train - n_heldout
    if not n_train or not n_heldout:
        raise ValueError(f"max_seq_len={config.max_seq_len} leaves {n_train} training and {n_heldout} "
                         f"held-out pairs of {config.dpo.data} (prompts that fill it are dropped)")

    def heldout_logps() -> torch.Tensor:
        return response_logps(trainer.model, trainer.eval_dataset, trainer.data_collator,
                              config.batch_size, trainer.accelerator.device)

    # Before training the policy is the reference (a copy, or LoRA's zero-initialised adapters),
    # so its implicit rewards are 0 by definition; a resume loads trained weights only in train().
    ref_logps = heldout_logps()
    before = preference_stats(ref_logps, ref_logps, config.dpo.beta)
    summary, resumed_step = train_resumably(trainer, out_dir)
    after = preference_stats(heldout_logps(), ref_logps, config.dpo.beta)
    log.info("held-out preference accuracy %.3f -> %.3f, margin %.4f -> %.4f",
             before["pref_acc"], after["pref_acc"], before["margin"], after["margin"])
    return trainer.model, {
        "pairs_train": n_train, "pairs_heldout": n_heldout, "steps": trainer.state.global_step,
        "resumed_from_step": resumed_step, "train_loss": summary.training_loss,
        "truncated_too_long": count_truncated(trainer.train_dataset, config.max_seq_len),
        **{f"heldout_{k}_before": v for k, v in before.items()},
        **{f"heldout_{k}_after": v for k, v in after.items()},
        **{f"dropped_{reason}": n for reason, n in sorted(drops.items())},
    }


def run_grpo(config: Config, model: Any, tokenizer: Any, out_dir: Path,
             use_cpu: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from tasks.align_grpo import run_grpo as run  # imports this module: loaded on use

    return run(config, model, tokenizer, out_dir, use_cpu)


def run_ppo(config: Config, model: Any, tokenizer: Any, out_dir: Path,
            use_cpu: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from tasks.align_ppo import run_ppo as run  # imports this module: loaded on use

    return run(config, model, tokenizer, out_dir, use_cpu)


# method -> trains `model` (the SFT model) in out_dir; returns the trained model and its stats
METHODS: dict[str, Callable[..., tuple[torch.nn.Module, dict[str, Any]]]] = {
    "dpo": run_dpo, "grpo": run_grpo, "ppo": run_ppo}


def run(config: Config, inputs: Mapping[str, Manifest], out_dir: Path, *, engine: Engine) -> StageResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.export import export_model
    from model.loop import resolve_device
    from model.lora import export_lora, trainable_parameters

    out_dir, sft_dir = Path(out_dir), Path(inputs["sft"].path) / "model"
    use_cpu = resolve_device(config.device).type == "cpu"
    log.info("aligning %s with %s on %s", sft_dir, config.method, "cpu" if use_cpu else "cuda")
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    model = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32)
    trained, stats = METHODS[config.method](config, model, tokenizer, out_dir, use_cpu)
    params = trainable_parameters(trained)
    artifacts = ["metrics.jsonl"]
    if config.lora is not None:
        export_lora(trained, tokenizer, out_dir / "model", out_dir / "adapter")
        artifacts.append("adapter/adapter_config.json")
    else:
        export_model(trained, tokenizer, out_dir / "model")
    shutil.rmtree(out_dir / CHECKPOINT_DIR, ignore_errors=True)  # the committed artifact is the export
    return StageResult(stats={"method": config.method, **stats, **params}, artifacts=artifacts)
