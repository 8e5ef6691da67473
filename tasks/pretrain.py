"""Pretrain stage: train a small Llama from scratch on the tokenize stage's token shards.

Batches are packed windows of `seq_len + 1` tokens from `tokens/train.bin` in the seeded epoch
order of `model.data` (step `s` reads stream positions `s * batch_size ...`), so the step is the
saved data position and a resumed run sees exactly the batches it would have seen. Validation
loss is measured on a fixed set of evenly spaced windows of `tokens/val.bin`.
Output: `model/` (HF dir with the tokenizer), `metrics.jsonl` (loss, lr, grad_norm, val_loss).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from pydantic import Field, model_validator
from transformers import AutoTokenizer

from model.data import read_tokens, window_starts
from model.export import export_model
from model.loop import Batch, LoopConfig, mean_token_loss, remove_checkpoints, train
from model.presets import ModelConfig, build_model, count_params
from tasks.stage import Engine, Manifest, MetricsLog, StageResult

VERSION = 1
log = logging.getLogger("gristmill.pretrain")


class Config(LoopConfig):
    """Pretraining: model shape, sequence length, and the shared optimisation knobs."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Shape of the model trained from scratch.")
    seq_len: int = Field(256, gt=0, description="Tokens per training sequence (each window holds seq_len + 1 "
                                                "tokens: inputs and their next-token targets).")
    val_windows: int = Field(32, gt=0, description="Number of fixed, evenly spaced val.bin windows the "
                                                   "validation loss is measured on.")

    @model_validator(mode="after")
    def _check_seq_len(self) -> "Config":
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        return self


def load_tokens(tokens_dir: Path, split: str, seq_len: int) -> np.ndarray:
    """Memory-mapped token ids of `split` ("train" or "val"), checked to hold at least one window."""
    data = read_tokens(tokens_dir, split)
    path = tokens_dir / f"{split}.bin"
    if len(data) < seq_len + 2:
        raise ValueError(f"{path} holds {len(data)} tokens, fewer than seq_len + 2 = {seq_len + 2}; "
                         "lower seq_len or tokenize more text")
    return data


def windows_batch(data: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    """Inputs and next-token labels from windows of seq_len + 1 tokens starting at `starts`."""
    windows = torch.from_numpy(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64))
    return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}


def train_starts(n_tokens: int, seq_len: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Window starts of training step `step`: a pure function of (seed, step). The whole global
    batch is read as rank 0 of 1; the training loop splits it across data-parallel processes."""
    return window_starts(n_tokens, seq_len, seed, position=step * batch_size, count=batch_size)


def val_batches(data: np.ndarray, config: Config) -> list[Batch]:
    """The fixed validation set: `val_windows` evenly spaced windows, in batches of batch_size."""
    starts = np.linspace(0, len(data) - config.seq_len - 1, num=config.val_windows).astype(np.int64)
    return [windows_batch(data, starts[i : i + config.batch_size], config.seq_len)
            for i in range(0, len(starts), config.batch_size)]


def run(config: Config, inputs: Mapping[str, Manifest], out_dir: Path, *, engine: Engine) -> StageResult:
    tok_root = Path(inputs["tokenize"].path)
    tokenizer = AutoTokenizer.from_pretrained(tok_root / "tokenizer")
    train_data = load_tokens(tok_root / "tokens", "train", config.seq_len)
    val_set = val_batches(load_tokens(tok_root / "tokens", "val", config.seq_len), config)

    torch.manual_seed(config.seed)
    model = build_model(config.model, tokenizer)
    params = count_params(model)
    log.info("model: %d params, %d train tokens, %d val windows of %d tokens",
             params, len(train_data), config.val_windows, config.seq_len)

    def get_batch(step: int) -> Batch:
        starts = train_starts(len(train_data), config.seq_len, config.batch_size, config.seed, step)
        return windows_batch(train_data, starts, config.seq_len)

    summary = train(model, get_batch, config, out_dir, MetricsLog(out_dir),
                    evaluate=lambda m: {"val_loss": mean_token_loss(m, val_set)}, log=log)
    export_model(model, tokenizer, out_dir / "model")
    remove_checkpoints(out_dir)  # the exported model is the artifact; optimizer state is not
    stats = {"final_train_loss": summary["final_train_loss"], "val_loss": summary["val_loss"],
             "params": params, "steps": summary["steps"], "tokens_seen": summary["tokens_seen"],
             "tokens_per_s": summary["tokens_per_s"], "resumed_from_step": summary["resumed_from_step"]}
    return StageResult(stats=stats, artifacts=["model/config.json", "model/generation_config.json"])
