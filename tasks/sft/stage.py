"""SFT stage: supervised fine-tuning of the pretrained model on chat conversations.

Sources (tasks.sft.conversations): the generated demo tasks, `messages` / prompt+response /
self-instruct JSONL, and OpenAssistant message-tree exports flattened to threads. Each
conversation is rendered with the one chat template stored with the tokenizer
(`gristmill.core.chat.render_with_mask`); the loss falls on assistant tokens only (their content and the
closing `<|im_end|>`). Over-long conversations are cut to `max_seq_len` tokens; those left with no
assistant token are dropped (both counted). A held-out share, split by opening user message so the
threads of one OpenAssistant tree stay on one side, measures assistant-token loss before and after.

Pretraining text keeps the model's language: with `pretrain_mix` > 0 every step also reads
`pretrain_windows` windows of the tokenize stage's train tokens (the windows pretraining reads, in
an order seeded like its batches) and its loss is (1 - pretrain_mix) * assistant-token loss +
pretrain_mix * next-token loss on those windows. Fine-tuning a small model on narrow conversations
alone overwrites its general next-token ability (the tiny preset's perplexities:
docs/benchmarks.md). Next-token loss on evenly spaced val windows is measured before and after
(`val_text_loss_*`) whenever the tokenize artifact is an input.

Full fine-tuning, or LoRA (`lora:`, model/lora.py) with the adapter saved to `adapter/` and merged
into the exported `model/`. With `packing`, examples share rows of up to `max_seq_len` tokens,
each with its own positions and attention block (model/packing.py); `batch_size` then counts rows.

Training runs on model/loop.py, the loop pretraining uses: exact resume from checkpoints in
out_dir (the state of LoRA runs included: only the adapters are trainable, and model, optimizer,
scheduler and RNG state are all checkpointed), spike rollback, Accelerate DDP and metrics.jsonl.
TRL's SFTTrainer is not used because it would bring a second loop with its own checkpoint layout;
TRL serves the packing (`trl.pack_dataset`) and PEFT the adapters. Batches follow a per-epoch
permutation drawn from (seed, epoch), so a resumed run sees the same batches.
Output: `model/` (plain HF model), `adapter/` (LoRA only), `metrics.jsonl`.
"""
from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gristmill.core.chat import Message, render_with_mask
from gristmill.core.stage import Engine, Manifest, MetricsLog, StageResult
from gristmill.model.checkpoint import CHECKPOINT_STATS, StoreMapping, checkpoint_place
from gristmill.model.data import load_tokens, spaced_batches, train_starts, windows_batch
from gristmill.model.export import export_model
from gristmill.model.loop import (
    IGNORE_INDEX,
    Batch,
    LossFn,
    causal_lm_loss,
    mean_token_loss,
    resolve_device,
    train,
)
from gristmill.model.lora import apply_lora, export_lora, trainable_parameters
from gristmill.model.packing import Example, collate_packed, pack_examples
from gristmill.model.parallel import is_rank0, launched_world_size
from gristmill.tasks.sft.config import Config
from gristmill.tasks.sft.conversations import load_conversations

log = logging.getLogger("gristmill.sft")
TEXT = "text_"  # key prefix of the pretraining windows inside a batch
VAL_TEXT_WINDOWS = 16  # evenly spaced val windows the text loss is measured on (16 x 256 tokens)
U = TypeVar("U")  # a unit of training data: an example, or a packed row of them


def sft_example(ids: list[int], mask: list[int]) -> Example:
    """Next-token inputs and labels: position t predicts ids[t+1], scored only where it is an
    assistant token."""
    labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(ids[1:], mask[1:])]
    return ids[:-1], labels


def encode_conversations(tokenizer: Any, convs: list[list[Message]], max_seq_len: int
                         ) -> tuple[list[Example], list[int], dict[str, int]]:
    """Render each conversation, cut it to max_seq_len tokens, and build labels. Returns the
    examples, the index in `convs` each came from, and counts of `truncated_<reason>` /
    `dropped_<reason>` events."""
    examples, kept, counts = [], [], Counter()
    for i, conv in enumerate(convs):
        ids, mask = render_with_mask(tokenizer, conv)
        if len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            counts["truncated_over_max_seq_len"] += 1
        if not any(mask[1:]):
            counts["dropped_no_assistant_tokens_after_truncation"] += 1
            continue
        examples.append(sft_example(ids, mask))
        kept.append(i)
    return examples, kept, dict(counts)


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


def conversation_group(conv: list[Message]) -> str:
    """Held-out split key: the opening user message. Threads flattened from one OpenAssistant tree
    share it, as do repeats of one prompt, so none of them leaks across the split."""
    opening = next((m["content"] for m in conv if m["role"] == "user"), "")
    return hashlib.sha256(opening.encode()).hexdigest()


def split_heldout(groups: Sequence[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices: whole groups, in a seeded order, go to the held-out side until it
    has ceil(fraction * n) items; a group that would leave training empty is skipped."""
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    order = np.random.default_rng(seed).permutation(len(members))
    names, target, heldout = list(members), math.ceil(fraction * len(groups)), []
    for k in order:
        if len(heldout) >= target:
            break
        if len(heldout) + len(members[names[k]]) < len(groups):
            heldout += members[names[k]]
    held = set(heldout)
    return [i for i in range(len(groups)) if i not in held], sorted(heldout)


def load_examples(config: Config, tokenizer: Any) -> tuple[list[Example], list[str], dict[str, int]]:
    """Examples from every source, their held-out groups, and `dropped_*`/`truncated_*` counts.
    A source with nothing left to train on is an error naming it."""
    examples, groups, counts = [], [], Counter()
    for source in config.data:
        convs, dropped = load_conversations(source, config.max_examples)
        counts.update({f"dropped_{reason}": n for reason, n in dropped.items()})
        encoded, kept, enc_counts = encode_conversations(tokenizer, convs, config.max_seq_len)
        if not encoded:
            raise ValueError(f"SFT data source {source!r}: none of its {len(convs)} conversations keeps an "
                             f"assistant token within max_seq_len={config.max_seq_len} ({enc_counts})")
        counts.update(enc_counts)
        examples += encoded
        groups += [conversation_group(convs[i]) for i in kept]
        log.info("%s: %d examples, %s", source, len(encoded), {**dropped, **enc_counts} or "nothing dropped")
    return examples, groups, dict(counts)


def text_tokens(config: Config, tokenize: Manifest | None) -> tuple[np.ndarray, np.ndarray] | None:
    """The tokenize stage's (train, val) token streams; None without that input, which only a
    run that mixes in no text may lack."""
    if tokenize is None:
        if config.pretrain_mix > 0:
            raise ValueError(f"sft.pretrain_mix={config.pretrain_mix} mixes in pretraining text, so the stage "
                             "needs the tokenize artifact as input 'tokenize' (or set pretrain_mix=0)")
        return None
    tokens_dir = Path(tokenize.path) / "tokens"
    return load_tokens(tokens_dir, "train", config.max_seq_len), load_tokens(tokens_dir, "val", config.max_seq_len)


def mixed_loss(loss_fn: LossFn, mix: float) -> LossFn:
    """(1 - mix) * `loss_fn` on the conversation rows + mix * mean next-token loss on the text
    windows (the batch keys prefixed TEXT), each a mean over its own labelled tokens, so the
    weight does not depend on how many tokens either side has."""

    def loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        convs = {k: v for k, v in batch.items() if not k.startswith(TEXT)}
        text = {k.removeprefix(TEXT): v for k, v in batch.items() if k.startswith(TEXT)}
        return (1 - mix) * loss_fn(model, convs) + mix * causal_lm_loss(model, text)

    return loss


def _batches(units: Sequence[U], collate_fn: Callable[[list[U], int], Batch], pad_id: int
             ) -> Callable[[list[int]], Batch]:
    """The batch of the units at some indices."""
    return lambda indices: collate_fn([units[i] for i in indices], pad_id)


def batch_source(config: Config, train_set: list[Example], pad_id: int, text: np.ndarray | None = None):
    """(get_batch(step) -> Batch, loss_fn, loop config, stats) for plain or packed batches, with
    `pretrain_windows` windows of `text` per step under TEXT-prefixed keys when pretrain_mix > 0."""
    if not config.packing:
        if config.tokens_per_step is not None:
            raise ValueError("tokens_per_step needs packing=true (rows of max_seq_len tokens); "
                             "without packing set batch_size / grad_accum_steps")
        n_units, batch_of, loss_fn, stats = len(train_set), _batches(train_set, collate, pad_id), causal_lm_loss, {}
    else:
        packed = pack_examples(train_set, config.max_seq_len)
        tokens = sum(len(ids) for ids, _ in train_set)
        n_units, batch_of, loss_fn = len(packed), _batches(packed, collate_packed, pad_id), causal_lm_loss
        stats = {"packed_rows": len(packed), "packed_fill": tokens / (len(packed) * config.max_seq_len)}
    loop_config = config.with_seq_len(config.max_seq_len, launched_world_size()) if config.packing else config

    mixing = config.pretrain_mix > 0
    if mixing:
        if text is None:
            raise ValueError("pretrain_mix > 0 needs the pretraining text (the tokenize stage's tokens)")
        loss_fn = mixed_loss(loss_fn, config.pretrain_mix)
    mixed_text = text if mixing else None

    def get_batch(step: int) -> Batch:
        batch = batch_of(epoch_indices(step, loop_config.batch_size, n_units, config.seed))
        if mixed_text is not None:  # a pure function of (seed, step), as the conversations are: resume stays exact
            starts = train_starts(len(mixed_text), config.max_seq_len, config.pretrain_windows, config.seed, step)
            batch.update({TEXT + k: v for k, v in windows_batch(mixed_text, starts, config.max_seq_len).items()})
        return batch

    return get_batch, loss_fn, loop_config, stats


def load_base(model_dir: Path, config: Config):
    """Tokenizer and fp32 model of the pretrain stage, checked against max_seq_len."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if config.max_seq_len > model.config.max_position_embeddings:
        raise ValueError(f"max_seq_len ({config.max_seq_len}) exceeds the model's "
                         f"max_position_embeddings ({model.config.max_position_embeddings})")
    return tokenizer, model


def run(config: Config, out_dir: Path, *, engine: Engine, store_mapping: StoreMapping | None, pretrain: Manifest,
        tokenize: Manifest | None = None) -> StageResult:
    """Fine-tune the pretrain stage's model; `tokenize` is needed only to mix in its text."""
    out_dir = Path(out_dir)
    torch.manual_seed(config.seed)  # LoRA's initial A matrices and adapter dropout
    tokenizer, model = load_base(Path(pretrain.path) / "model", config)
    examples, groups, counts = load_examples(config, tokenizer)
    train_idx, heldout_idx = split_heldout(groups, config.heldout_fraction, config.seed)
    train_set, heldout = [examples[i] for i in train_idx], [examples[i] for i in heldout_idx]
    pad_id = tokenizer.pad_token_id
    text = text_tokens(config, tokenize)
    # Held-out loss always runs unpacked: equal to the packed loss (tested), and comparable across runs.
    measured = {"heldout_loss": [collate(heldout[i : i + config.batch_size], pad_id)
                                 for i in range(0, len(heldout), config.batch_size)],
                "val_text_loss": spaced_batches(text[1], config.max_seq_len, VAL_TEXT_WINDOWS, config.batch_size)
                if text is not None else []}
    measured = {name: batches for name, batches in measured.items() if batches}

    def evaluate(m: torch.nn.Module) -> dict[str, float]:
        return {name: mean_token_loss(m, batches) for name, batches in measured.items()}

    device = resolve_device(config.device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        # transformers wraps PreTrainedModel.to with functools.wraps, which the checker reads as an
        # unbound function (the device taken for `self`)
        before = evaluate(model.to(device))  # pyright: ignore[reportArgumentType]
    log.info("%d train / %d held-out examples, before: %s, %s", len(train_set), len(heldout), before, counts)
    trained = apply_lora(model, config.lora) if config.lora is not None else model  # model itself, or wrapped
    get_batch, loss_fn, loop_config, batch_stats = batch_source(
        config, train_set, pad_id, text[0] if text is not None else None)
    checkpoints = checkpoint_place(out_dir, store_mapping)
    summary = train(trained, get_batch, loop_config, checkpoints, MetricsLog(out_dir), loss_fn=loss_fn,
                    evaluate=evaluate if measured else None, log=log)
    params = trainable_parameters(trained)
    artifacts = ["model/config.json", "model/generation_config.json"]
    if config.lora is not None:
        artifacts.append("adapter/adapter_config.json")
    if config.lora is None:
        export_model(model, tokenizer, out_dir / "model")  # every rank: a sharded model is gathered first
    elif is_rank0():
        export_lora(trained, tokenizer, out_dir / "model", out_dir / "adapter")
    if is_rank0():
        checkpoints.remove()
    # Pretraining tokens the loop's tokens_seen leaves out (it counts the conversation rows).
    text_tokens_seen = summary["steps"] * config.pretrain_windows * config.max_seq_len if config.pretrain_mix else 0
    stats = {"examples_train": len(train_set), "examples_heldout": len(heldout),
             **{f"{name}_{when}": values.get(name, float("nan")) for name in ("heldout_loss", "val_text_loss")
                for when, values in (("before", before), ("after", summary))},
             "text_tokens_seen": text_tokens_seen,
             **{k: summary[k] for k in ("final_train_loss", "steps", "tokens_seen", "tokens_per_s",
                                        "resumed_from_step", "world_size")},
             **{k: summary[k] for k in CHECKPOINT_STATS if k in summary}, **params, **batch_stats, **counts}
    return StageResult(stats=stats, artifacts=artifacts)
