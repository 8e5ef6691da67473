"""SFT stage: supervised fine-tuning of the pretrained model on chat conversations.

Each conversation is rendered with the chat template stored with the tokenizer
(`tasks.chat.render_with_mask`); the loss falls on assistant tokens only (their content and the
closing `<|im_end|>`). A held-out share of the conversations measures assistant-token loss before
and after training. Batches follow a per-epoch permutation drawn from (seed, epoch), so a
resumed run sees the same batches. Output: `model/`, `metrics.jsonl`.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from pydantic import Field
from transformers import AutoModelForCausalLM, AutoTokenizer

from model.export import export_model
from model.loop import (IGNORE_INDEX, Batch, LoopConfig, mean_token_loss, remove_checkpoints,
                        resolve_device, train)
from tasks.chat import render_with_mask
from tasks.conversations import load_conversations
from tasks.stage import Engine, Manifest, MetricsLog, StageResult, data_fingerprint

VERSION = 1
log = logging.getLogger("gristmill.sft")

Example = tuple[list[int], list[int]]  # (input ids, labels aligned to them; IGNORE_INDEX = no loss)


class Config(LoopConfig):
    """Supervised fine-tuning: data sources, sequence limits, held-out share, and the loop knobs."""

    data: list[str] = Field(["demo:arithmetic"], min_length=1,
                            description="Conversation sources: 'demo:arithmetic' or JSONL(.gz) paths "
                                        "(messages, prompt/response, or self-instruct formats).")
    max_examples: int | None = Field(None, gt=0, description="At most this many conversations per source "
                                                             "(None: all; the demo then gives 500).")
    max_seq_len: int = Field(256, gt=1, description="Rendered conversations longer than this many tokens "
                                                    "are truncated (and counted).")
    heldout_fraction: float = Field(0.1, ge=0, lt=1, description="Share of conversations held out to "
                                                                 "measure assistant-token loss before/after.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate of AdamW.")


def fingerprint(config: Config) -> str:
    """Digest of the data files the config points at, so an edited file triggers a re-run."""
    return data_fingerprint(config.data)


def sft_example(ids: list[int], mask: list[int]) -> Example:
    """Next-token inputs and labels: position t predicts ids[t+1], scored only where it is an
    assistant token."""
    labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(ids[1:], mask[1:])]
    return ids[:-1], labels


def encode_conversations(tokenizer: Any, convs: list, max_seq_len: int) -> tuple[list[Example], dict[str, int]]:
    """Render, truncate to max_seq_len tokens, and build labels; counts truncations and drops."""
    examples, counts = [], {"truncated": 0, "dropped_no_assistant_tokens_after_truncation": 0}
    for conv in convs:
        ids, mask = render_with_mask(tokenizer, conv)
        if len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            counts["truncated"] += 1
        if not any(mask[1:]):
            counts["dropped_no_assistant_tokens_after_truncation"] += 1
            continue
        examples.append(sft_example(ids, mask))
    return examples, counts


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Right-padded batch; padding is masked out of attention and loss."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        attention[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


def epoch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """Example indices of step `step`: consecutive slices of per-epoch permutations seeded by
    (seed, epoch), a pure function of the step."""
    positions = range(step * batch_size, (step + 1) * batch_size)
    perms = {e: np.random.default_rng((seed, e)).permutation(n) for e in {p // n for p in positions}}
    return [int(perms[p // n][p % n]) for p in positions]


def load_data(config: Config, tokenizer: Any) -> tuple[list[Example], list[Example], dict[str, int]]:
    """Train and held-out examples, and the counts of what was dropped or truncated."""
    convs, counts = [], {}
    for source in config.data:
        loaded, dropped = load_conversations(source, config.max_examples)
        convs += loaded
        for reason, n in dropped.items():
            counts[f"dropped_{reason}"] = counts.get(f"dropped_{reason}", 0) + n
    examples, enc_counts = encode_conversations(tokenizer, convs, config.max_seq_len)
    if not examples:
        raise ValueError(f"no SFT example keeps an assistant token within max_seq_len={config.max_seq_len}")
    order = np.random.default_rng(config.seed).permutation(len(examples))
    n_heldout = min(math.ceil(config.heldout_fraction * len(examples)), len(examples) - 1)
    heldout = [examples[i] for i in order[:n_heldout]]
    train_set = [examples[i] for i in order[n_heldout:]]
    return train_set, heldout, {**counts, **enc_counts}


def run(config: Config, inputs: Mapping[str, Manifest], out_dir: Path, *, engine: Engine) -> StageResult:
    model_dir = Path(inputs["pretrain"].path) / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if config.max_seq_len > model.config.max_position_embeddings:
        raise ValueError(f"max_seq_len ({config.max_seq_len}) exceeds the model's "
                         f"max_position_embeddings ({model.config.max_position_embeddings})")
    train_set, heldout, counts = load_data(config, tokenizer)
    pad_id = tokenizer.pad_token_id
    heldout_batches = [collate(heldout[i : i + config.batch_size], pad_id)
                       for i in range(0, len(heldout), config.batch_size)]
    evaluate = (lambda m: {"heldout_loss": mean_token_loss(m, heldout_batches)}) if heldout else None
    device = resolve_device(config.device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        before = mean_token_loss(model.to(device), heldout_batches) if heldout else float("nan")
    log.info("%d train / %d held-out conversations, held-out assistant loss %.4f, %s",
             len(train_set), len(heldout), before, counts)

    def get_batch(step: int) -> Batch:
        idx = epoch_indices(step, config.batch_size, len(train_set), config.seed)
        return collate([train_set[i] for i in idx], pad_id)

    summary = train(model, get_batch, config, out_dir, MetricsLog(out_dir), evaluate=evaluate, log=log)
    export_model(model, tokenizer, out_dir / "model")
    remove_checkpoints(out_dir)
    stats = {"examples_train": len(train_set), "examples_heldout": len(heldout),
             "heldout_loss_before": before, "heldout_loss_after": summary.get("heldout_loss", float("nan")),
             **{k: summary[k] for k in ("final_train_loss", "steps", "tokens_seen", "tokens_per_s",
                                        "resumed_from_step")}, **counts}
    return StageResult(stats=stats, artifacts=["model/config.json", "model/generation_config.json"])
