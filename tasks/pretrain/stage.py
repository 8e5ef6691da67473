"""Pretrain stage: train a small Llama from scratch on the tokenize stage's token shards.

Batches are packed windows of `seq_len + 1` tokens from `tokens/train.bin` in the seeded epoch
order of `gristmill.model.data` (step `s` reads stream positions `s * batch_size ...`), so the step is the
saved data position and a resumed run sees exactly the batches it would have seen. Validation
loss is measured on a fixed set of evenly spaced windows of `tokens/val.bin`, also as bits per
byte, next to the unigram baseline (cross-entropy of val tokens under train-token frequencies).
Output: `model/` (HF dir with the tokenizer), `metrics.jsonl` (loss, lr, grad_norm, tokens_per_s,
mfu, val_loss, val_bpb, rollback events).

Distributed: `run` is the same function in every data-parallel process: the pipeline launches it
as its `launch` section says (core/launch.py: Accelerate, or Ray Train), and `python -m
gristmill.tasks.pretrain` runs it under `torchrun` / `accelerate launch` by hand (see infra/accelerate/).
Every process takes part in the export (a sharded model is gathered); process 0 writes it.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from gristmill.core.stage import Engine, Manifest, MetricsLog, SerialEngine, StageResult
from gristmill.core.units import bits_per_byte
from gristmill.model.checkpoint import CHECKPOINT_STATS, StoreMapping, checkpoint_place
from gristmill.model.data import (
    load_tokens,
    read_tokens,
    spaced_batches,
    train_starts,
    windows_batch,
)
from gristmill.model.export import export_model
from gristmill.model.loop import Batch, mean_token_loss, train
from gristmill.model.parallel import is_rank0, launched_world_size, leave_process_group
from gristmill.model.plan import flops_per_token
from gristmill.model.presets import build_model, count_params
from gristmill.tasks.pretrain.config import Config

log = logging.getLogger("gristmill.pretrain")

UNIGRAM_CHUNK_TOKENS = 1 << 24  # bincount in chunks: np.bincount widens the ids to int64


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats per token) of `val` under the unigram distribution of `train` with
    add-one smoothing: the loss of a model that ignores context, a baseline to beat."""
    counts = np.ones(vocab_size, dtype=np.float64)
    for start in range(0, len(train), UNIGRAM_CHUNK_TOKENS):
        counts += np.bincount(train[start : start + UNIGRAM_CHUNK_TOKENS], minlength=vocab_size)[:vocab_size]
    log_p = np.log(counts) - np.log(counts.sum())
    val_counts = np.zeros(vocab_size, dtype=np.float64)
    for start in range(0, len(val), UNIGRAM_CHUNK_TOKENS):
        val_counts += np.bincount(val[start : start + UNIGRAM_CHUNK_TOKENS], minlength=vocab_size)[:vocab_size]
    return float(-(val_counts * log_p).sum() / val_counts.sum())


def bytes_per_token(tokens_dir: Path) -> float:
    """UTF-8 bytes per token of the whole val split (tokens/meta.json)."""
    meta = json.loads((Path(tokens_dir) / "meta.json").read_text())
    return meta["val_bytes"] / meta["val_tokens"]


def val_batches(data: np.ndarray, config: Config) -> list[Batch]:
    """The fixed validation set: `val_windows` evenly spaced windows, in batches of batch_size."""
    return spaced_batches(data, config.seq_len, config.val_windows, config.batch_size)


def run(config: Config, out_dir: Path, *, engine: Engine, store_mapping: StoreMapping | None,
        tokenize: Manifest) -> StageResult:
    # tokens_per_step -> batch_size (all processes) and grad_accum_steps (micro-batches per process)
    config = config.with_seq_len(config.seq_len, launched_world_size())
    tok_root = Path(tokenize.path)
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

    bytes_per_tok = bytes_per_token(tok_root / "tokens")

    def evaluate(m: torch.nn.Module) -> dict[str, float]:
        val_loss = mean_token_loss(m, val_set)
        return {"val_loss": val_loss, "val_bpb": bits_per_byte(val_loss, bytes_per_tok)}

    step_flops = flops_per_token(config.model, len(tokenizer), config.seq_len)
    checkpoints = checkpoint_place(out_dir, store_mapping)
    summary = train(model, get_batch, config, checkpoints, MetricsLog(out_dir), evaluate=evaluate, log=log,
                    flops_per_token=step_flops)
    unigram = unigram_loss(train_data, read_tokens(tok_root / "tokens", "val"), len(tokenizer))
    log.info("val_loss %.4f nats (%.4f bits/byte); unigram baseline %.4f nats",
             summary["val_loss"], summary["val_bpb"], unigram)
    export_model(model, tokenizer, out_dir / "model")  # every rank: a sharded model is gathered first
    if is_rank0():
        checkpoints.remove()  # the exported model is the artifact; optimizer state is not
    stats = {"final_train_loss": summary["final_train_loss"], "val_loss": summary["val_loss"],
             "val_bpb": summary["val_bpb"], "unigram_val_loss": unigram,
             "unigram_val_bpb": bits_per_byte(unigram, bytes_per_tok),
             "params": params, "steps": summary["steps"], "tokens_seen": summary["tokens_seen"],
             "flops_per_token": step_flops, "flops": step_flops * summary["tokens_seen"],
             "tokens_per_s": summary["tokens_per_s"], "resumed_from_step": summary["resumed_from_step"],
             "rollbacks": summary["rollbacks"], "world_size": summary["world_size"],
             "first_step_s": summary["first_step_s"],
             **{key: summary[key] for key in ("mfu", "peak_memory_gib", *CHECKPOINT_STATS) if key in summary}}
    return StageResult(stats=stats, artifacts=["model/config.json", "model/generation_config.json"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stage outside the pipeline, once per process of a data-parallel launch:

        torchrun --standalone --nproc_per_node 2 -m gristmill.tasks.pretrain TOKENIZE_DIR OUT_DIR --config '{...}'
        accelerate launch --config_file infra/accelerate/ddp_gpu.yaml -m gristmill.tasks.pretrain ...

    TOKENIZE_DIR is a tokenize stage output; the JSON config holds Config fields. Process 0
    writes OUT_DIR/summary.json (the stage's stats); checkpoints stay in OUT_DIR/checkpoints."""
    parser = argparse.ArgumentParser(prog="python -m gristmill.tasks.pretrain", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tokenize_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--config", default="{}", help="Config fields as a JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = Config(**json.loads(args.config))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = run(config, args.out_dir, engine=SerialEngine(), store_mapping=None,
                     tokenize=Manifest.of_directory("tokenize", args.tokenize_dir))
        if is_rank0():
            (args.out_dir / "summary.json").write_text(json.dumps(result.stats, indent=1) + "\n")
    finally:
        leave_process_group()
    return 0

