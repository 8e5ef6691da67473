"""Evaluate stage: a report card comparing the base, SFT and aligned models.

For each model (the upstream stages pretrain, sft and align, labelled base / sft / aligned):

1. held-out perplexity and bits per byte on the tokenize stage's `tokens/val.bin`, beside xz and
   zstd on the same bytes, alone and given the training text (compression.py, `compression.json`);
2. accuracy on generated arithmetic test problems (greedy chat generation, `gristmill.core.arithmetic`);
3. optionally, benchmark files (`tasks`: HellaSwag, ARC, MMLU-Redux, WinoGrande, LAMBADA, GSM8K...),
   scored by the benchmark engine (engine.py), the one behind `gristmill evaluate`.

Writes `results.json` (nested by model, with the align stage's own held-out measurements before
and after alignment: preference accuracy and margin for DPO, greedy accuracy on held-out
problems for GRPO) and `contamination.json` (per model and task, the items found in that model's
training data: contamination.py). The report card that compares the models is rendered from
these by the flow (flows/report_card.py), not here.
Each model's results are also kept in `per_model/<label>.json` as it finishes, and its parts
(perplexity + arithmetic, each benchmark file with its per-item JSONL) in `per_model/<label>/`,
so a killed run resumes with the next model or the next task.
"""
from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

import gristmill.core.arithmetic as arithmetic
from gristmill.core.chat import prompt_ids
from gristmill.core.progress import Reporter
from gristmill.core.stage import Engine, Manifest, StageResult
from gristmill.core.units import bits_per_byte
from gristmill.model.generate import generate_greedy
from gristmill.tasks.evaluate import compression
from gristmill.tasks.evaluate.compression import token_bytes
from gristmill.tasks.evaluate.config import COMPRESSION_PREFIX, MODEL_LABELS, Config
from gristmill.tasks.evaluate.contamination import clean_scores, mark_items
from gristmill.tasks.evaluate.engine import (
    EvalOptions,
    evaluate_task,
    load_model,
    load_tasks,
    summarize,
    write_results,
)

log = logging.getLogger("gristmill.evaluate")

# --- perplexity and bits per byte ---------------------------------------------------------------

def eval_windows(n_tokens: int, seq_len: int, max_eval_tokens: int) -> tuple[int, int]:
    """(window length, number of windows): non-overlapping windows of `seq_len` predicted tokens,
    each needing one extra token of input; a val split shorter than one window gives one window
    over all of it."""
    window = min(seq_len, n_tokens - 1)
    if window < 1:
        raise ValueError(f"val split has {n_tokens} tokens; need at least 2")
    return window, max(1, min((n_tokens - 1) // window, max_eval_tokens // window))


def sum_nll(model: Any, tokens: np.ndarray, window: int, n_windows: int, batch_size: int,
            device: str) -> float:
    """Summed next-token NLL in nats over `n_windows` consecutive windows from the start of `tokens`."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    for first in range(0, n_windows, batch_size):
        rows = [np.asarray(tokens[i * window: (i + 1) * window + 1], dtype=np.int64)
                for i in range(first, min(first + batch_size, n_windows))]
        batch = torch.from_numpy(np.stack(rows)).to(device)
        with torch.no_grad():
            logits = model(input_ids=batch[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
    return total


def val_tokens(tokenize_dir: Path) -> np.ndarray:
    meta = json.loads((tokenize_dir / "tokens" / "meta.json").read_text())
    return np.memmap(tokenize_dir / "tokens" / "val.bin", dtype=meta["dtype"], mode="r")


def scored_text(tokenize_dir: Path, config: Config, tokenizer: Any) -> bytes:
    """The exact bytes perplexity scores: those of the predicted tokens, tokens 1 .. n of val.bin
    (each window predicts the `window` tokens after its first)."""
    tokens = val_tokens(tokenize_dir)
    window, n_windows = eval_windows(len(tokens), config.seq_len, config.max_eval_tokens)
    return token_bytes(tokenizer, tokens[1 : window * n_windows + 1])


def _tokenizer(tokenize_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenize_dir / "tokenizer")


def perplexity(model: Any, tokenize_dir: Path, config: Config, device: str, scored_bytes: int
               ) -> dict[str, float]:
    tokens = val_tokens(tokenize_dir)
    window, n_windows = eval_windows(len(tokens), config.seq_len, config.max_eval_tokens)
    nll = sum_nll(model, tokens, window, n_windows, config.batch_size, device)
    n_eval = window * n_windows
    return {"val_loss": nll / n_eval, "val_ppl": math.exp(nll / n_eval),
            "val_bpb": bits_per_byte(nll / n_eval, scored_bytes / n_eval), "val_tokens_evaluated": n_eval,
            "val_bytes_covered": scored_bytes}


def compressor_baselines(tokenize_dir: Path, config: Config) -> dict[str, float]:
    """xz and zstd on the bytes val_bpb is measured on, alone and given the training text
    (compression.py), capped at `config.compression_train_mb`."""
    train = np.memmap(tokenize_dir / "tokens" / "train.bin", dtype=val_tokens(tokenize_dir).dtype, mode="r")
    cap = int(config.compression_train_mb * 2**20)
    tokenizer = _tokenizer(tokenize_dir)
    return compression.baselines(scored_text(tokenize_dir, config, tokenizer),
                                 compression.train_text(tokenizer, train, cap))


# --- arithmetic ---------------------------------------------------------------------------------

def arithmetic_accuracy(model: Any, tokenizer: Any, config: Config, device: str) -> dict[str, Any]:
    probs = arithmetic.problems("test", config.arith_problems, config.arith_seed)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": p.question}]) for p in probs]
    completions = generate_greedy(model, tokenizer, prompts, config.max_new_tokens, device, config.batch_size)
    correct = [arithmetic.is_correct(c, p) for c, p in zip(completions, probs)]
    examples = [{"question": p.question, "answer": p.answer, "completion": c}
                for p, c in list(zip(probs, completions))[:5]]
    return {"arith_acc": sum(correct) / len(correct), "arith_n": len(correct), "arith_examples": examples}


# --- per model ----------------------------------------------------------------------------------

def _perplexity_and_arithmetic(model: Any, tokenizer: Any, model_dir: Path, tokenize_dir: Path,
                                config: Config, device: str, scored_bytes: int) -> dict[str, Any]:
    meta = json.loads((tokenize_dir / "tokens" / "meta.json").read_text())
    if len(tokenizer) != meta["vocab_size"]:
        raise ValueError(f"{model_dir}: tokenizer has {len(tokenizer)} tokens but the val split "
                         f"was encoded with vocab_size {meta['vocab_size']}")
    if config.seq_len > model.config.max_position_embeddings:
        raise ValueError(f"seq_len={config.seq_len} exceeds the model's max positions "
                         f"({model.config.max_position_embeddings}) in {model_dir}")
    results: dict[str, Any] = perplexity(model, tokenize_dir, config, device, scored_bytes)
    results.update(arithmetic_accuracy(model, tokenizer, config, device))
    return results


def evaluate_model(model_dir: Path, tokenize_dir: Path, config: Config, device: str, work: Path,
                   marked: Mapping[str, list[int]], scored_bytes: int,
                   progress: Reporter | None = None) -> dict[str, Any]:
    """Perplexity, arithmetic and every benchmark file for one model, each task's score with its
    contaminated items (`marked`: task -> item indices) counted and the clean rest's accuracy.
    Each part is kept in `work` as it finishes (core.json, tasks/<task>.json + its per-item
    JSONL, each written atomically), so a killed run resumes with the next part; the model is
    loaded only if a part is missing. `progress` advances by one per part."""
    progress = progress or Reporter("parts", enabled=False)
    loaded: list[tuple[Any, Any]] = []

    def model_and_tokenizer() -> tuple[Any, Any]:
        if not loaded:
            loaded.append(load_model(model_dir, device))
        return loaded[0]

    core_file = work / "core.json"
    if core_file.exists():
        results: dict[str, Any] = json.loads(core_file.read_text())
    else:
        results = _perplexity_and_arithmetic(*model_and_tokenizer(), model_dir, tokenize_dir, config, device,
                                             scored_bytes)
        write_results(core_file, results, [])
    progress.advance(1)
    options = EvalOptions(batch_size=config.batch_size, max_new_tokens=config.gsm8k_max_new_tokens,
                          samples=config.gsm8k_samples)
    tasks = {}
    for data in load_tasks(config.tasks, limit=config.limit, delimiters=config.delimiters):
        done = work / "tasks" / f"{data.name}.json"
        if not done.exists():
            summary, rows = evaluate_task(*model_and_tokenizer(), data, options, device)
            write_results(done, summary, rows)
            log.info("%s: %s acc %.4f on %d items", model_dir, data.name, summary["acc"], summary["n"])
        rows = [json.loads(line) for line in done.with_name(f"{data.name}.items.jsonl").open()]
        tasks[data.name] = {**json.loads(done.read_text()),
                            **clean_scores(rows, marked.get(data.name, []))}
        progress.advance(1)
    return {**results, **summarize(tasks)}


def flat_stats(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """`{label}_{metric}` for every numeric result: base_val_bpb, aligned_core,
    sft_arc_easy_part1_acc, base_mmlu_redux_part1_subject_anatomy_acc... (MLflow metric names)."""
    stats: dict[str, float] = {}
    for label, res in results.items():
        for key, value in res.items():
            if _is_number(value):
                stats[f"{label}_{key}"] = value
        for task, scores in res.get("tasks", {}).items():
            for key, value in scores.items():
                if _is_number(value):
                    stats[f"{label}_{task}_{key}"] = value
            for subject, sub in scores.get("subjects", {}).items():
                stats[f"{label}_{task}_subject_{subject}_acc"] = sub["acc"]
    return stats


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- alignment ----------------------------------------------------------------------------------

_BEFORE_AFTER = re.compile(r"heldout_(?P<metric>.+)_(?P<when>before|after)")
ALIGN_COUNTS = ("pairs_heldout", "prompts_heldout", "steps")  # align stats shown beside the numbers


def alignment_summary(align_stats: Mapping[str, Any]) -> dict[str, Any]:
    """The align stage's held-out numbers as {"method", "<count>"..., "heldout": {metric: {"before",
    "after"}}}; empty when the stats hold none (an align artifact without them)."""
    heldout: dict[str, dict[str, float]] = {}
    for key, value in align_stats.items():
        match = _BEFORE_AFTER.fullmatch(key)
        if match and isinstance(value, (int, float)):
            heldout.setdefault(match["metric"], {})[match["when"]] = value
    heldout = {m: v for m, v in sorted(heldout.items()) if v.keys() == {"before", "after"}}
    if not heldout:
        return {}
    counts = {k: align_stats[k] for k in ALIGN_COUNTS if k in align_stats}
    return {"method": align_stats.get("method", "?"), **counts, "heldout": heldout}


# --- stage --------------------------------------------------------------------------------------

def run(config: Config, out_dir: Path, *, engine: Engine, collect: Manifest, tokenize: Manifest,
        pretrain: Manifest, sft: Manifest, align: Manifest) -> StageResult:
    """Evaluate the models of pretrain, sft and align on tokenize's held-out tokens and the
    benchmark files, each item marked when its model's training data (from collect on) holds it."""
    from gristmill.model.loop import resolve_device

    out_dir = Path(out_dir)
    device = resolve_device(config.device).type
    tokenize_dir = Path(tokenize.path)
    per_model = out_dir / "per_model"
    per_model.mkdir(parents=True, exist_ok=True)
    contamination = out_dir / "contamination.json"
    if not contamination.exists():  # the benchmark items each model's training data holds
        marks = mark_items(list(config.tasks), config.limit, [collect, sft, align]) if config.tasks else {}
        contamination.write_text(json.dumps(marks, indent=2, sort_keys=True) + "\n")
    marks = json.loads(contamination.read_text())
    baselines_file = out_dir / "compression.json"
    if not baselines_file.exists():  # one figure for every model: it depends on the val split only
        baselines_file.write_text(json.dumps(compressor_baselines(tokenize_dir, config), indent=2) + "\n")
    baselines = json.loads(baselines_file.read_text())
    results: dict[str, dict[str, Any]] = {}
    models = dict(zip(MODEL_LABELS, (pretrain, sft, align)))  # report label -> model, in column order
    parts = 1 + len(config.tasks)  # per model: perplexity and arithmetic, then each benchmark file
    with Reporter("parts", unit="part") as progress:
        progress.start(len(models) * parts)
        for label, trained in models.items():
            done = per_model / f"{label}.json"
            if done.exists():  # finished before a crash; same config, so the same result
                results[label] = json.loads(done.read_text())
                progress.advance(parts)
                continue
            log.info("evaluating %s (%s) on %s", label, trained.key, device)
            results[label] = evaluate_model(Path(trained.path) / "model", tokenize_dir, config, device,
                                            per_model / label, marks.get(label, {}),
                                            int(baselines["scored_bytes"]), progress)
            done.write_text(json.dumps(results[label], indent=2, sort_keys=True))
            log.info("%s: ppl %.2f bpb %.4f arith %.3f", label, results[label]["val_ppl"],
                     results[label]["val_bpb"], results[label]["arith_acc"])

    upstream = {"tokenize": tokenize.key, "pretrain": pretrain.key, "sft": sft.key, "align": align.key}
    alignment = alignment_summary(align.stats)
    payload = {"models": results, "alignment": alignment, "compression": baselines, "upstream": upstream,
               "device": device}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    stats = flat_stats(results) | {f"{COMPRESSION_PREFIX}{k}": v for k, v in baselines.items()}
    for metric, values in alignment.get("heldout", {}).items():
        stats.update({f"align_heldout_{metric}_{when}": v for when, v in values.items()})
    return StageResult(stats=stats, artifacts=["results.json", "contamination.json", "compression.json"])
