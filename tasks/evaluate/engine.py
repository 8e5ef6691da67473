"""The benchmark engine: score a Hugging Face causal LM on benchmark files, one task at a time.

Used by `gristmill evaluate MODEL_DIR --task FILE ...` (flows/cli.py) and by the evaluate stage
for the base, SFT and aligned models, so both report the same numbers for the same files.
Each task gives a summary (accuracy, acc_norm, accuracy centred on chance, standard errors,
counts) and one row per item (gold, prediction, per-choice log-likelihoods) for auditing.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gristmill.tasks.evaluate import metrics
from gristmill.tasks.evaluate.formats import EvalDataError, Item, TaskData

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """How to run the tasks (not what they are: that is the files)."""

    batch_size: int = 16  # requests per forward pass / prompts per generate call
    shots: int = 5  # GSM8K worked examples before each question
    max_new_tokens: int = 256  # GSM8K generation budget per answer (lm-eval's max_gen_toks)
    samples: int = 0  # GSM8K sampled answers per problem for pass@k (0: greedy only)
    temperature: float = 0.8  # sampling temperature for pass@k
    include_flagged: bool = False  # score MMLU-Redux items whose error_type is not "ok"
    seed: int = 0  # torch seed before sampling


def load_model(model_dir: Path, device: str) -> tuple[Any, Any]:
    """Model and tokenizer of an HF directory, in float32 (CPU and GPU then agree up to kernel
    rounding); ValueError naming the directory when it has no tokenizer or no model, or the
    weights file that is damaged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{model_dir}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "save one with tokenizer.save_pretrained(DIR)")
    _check_weights(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # transformers wraps PreTrainedModel.to with functools.wraps, which the checker reads as an
    # unbound function (the device taken for `self`)
    model = model.to(device).eval()  # pyright: ignore[reportArgumentType]
    return model, tokenizer


def _check_weights(model_dir: Path) -> None:
    """ValueError naming the first weight file safetensors cannot open (cut short, not safetensors
    at all): opened here, header and length only, because transformers' own error names no file."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path}: damaged weights file: {error}") from None


def _choice(scorer: Any, data: TaskData, options: EvalOptions) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    flagged: dict[str, int] = {}
    items: list[Item] = []
    for item in data.items:
        error = str(item.meta.get("error_type", "ok"))
        if error.lower() != "ok":  # MMLU-Redux writes "ok" and "Ok"
            flagged[error] = flagged.get(error, 0) + 1
        if error.lower() == "ok" or options.include_flagged:
            items.append(item)
    if not items:
        raise EvalDataError(f"{data.path}: every item is flagged ({flagged}); pass include_flagged to score them")
    rows = []
    for item, scores in zip(items, scorer.score_groups([item.requests for item in items])):
        lls = np.array([ll for ll, _ in scores])
        pred, pred_norm = int(np.argmax(lls)), int(np.argmax(lls / np.array(item.norm_chars)))
        rows.append({"id": item.index, "gold": item.gold, "pred": pred, "pred_norm": pred_norm,
                     "correct": pred == item.gold, "correct_norm": pred_norm == item.gold,
                     "loglik": lls.tolist(), **item.meta})
    chance = metrics.mean([1 / len(item.requests) for item in items])
    summary: dict[str, Any] = {**metrics.accuracy_block([float(r["correct"]) for r in rows]),
                               **metrics.accuracy_block([float(r["correct_norm"]) for r in rows], "acc_norm"),
                               "chance": chance}
    summary["centered_acc"] = metrics.centered(summary["acc"], chance)
    if data.format == "mmlu":
        summary.update(_by_subject(rows), flagged=flagged)
    return summary, rows


def _by_subject(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-subject accuracy and their macro mean (MMLU reports both)."""
    subjects: dict[str, list[float]] = {}
    for row in rows:
        subjects.setdefault(row.get("subject", ""), []).append(float(row["correct"]))
    per = {s: {"acc": metrics.mean(v), "n": len(v)} for s, v in sorted(subjects.items())}
    return {"subjects": per, "macro_acc": metrics.mean([v["acc"] for v in per.values()])}


def _greedy(scorer: Any, data: TaskData) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    results = scorer.loglikelihoods([item.requests[0] for item in data.items])
    rows = [{"id": item.index, "gold": item.gold, "correct": greedy, "loglik": [ll]}
            for item, (ll, greedy) in zip(data.items, results)]
    summary = {**metrics.accuracy_block([float(r["correct"]) for r in rows]),
               "perplexity": metrics.perplexity([ll for ll, _ in results])}
    return summary, rows


def _generate(model: Any, tokenizer: Any, max_length: int, data: TaskData, options: EvalOptions,
              device: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import torch

    from gristmill.tasks.evaluate.generation import final_number, generate_answers

    generate = functools.partial(generate_answers, model, tokenizer, data.items, shots=options.shots,
                                 max_new_tokens=options.max_new_tokens, device=device,
                                 batch_size=options.batch_size, max_length=max_length)
    greedy = generate()
    rows = []
    for item, (completion,) in zip(data.items, greedy):
        pred = final_number(completion)
        rows.append({"id": item.index, "gold": item.gold, "pred": pred, "correct": pred == item.gold,
                     "completion": completion})
    summary: dict[str, Any] = metrics.accuracy_block([float(r["correct"]) for r in rows])
    if options.samples:
        torch.manual_seed(options.seed)
        sampled = generate(num_samples=options.samples, temperature=options.temperature)
        for row, completions in zip(rows, sampled):
            row["samples_correct"] = sum(final_number(c) == row["gold"] for c in completions)
        for k in sorted({1, options.samples}):
            summary[f"pass_at_{k}"] = metrics.mean([metrics.pass_at_k(options.samples, r["samples_correct"], k)
                                                   for r in rows])
        summary["samples"] = options.samples
    return summary, rows


def evaluate_task(model: Any, tokenizer: Any, data: TaskData, options: EvalOptions,
                  device: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary, per-item rows) of one parsed benchmark file."""
    from gristmill.tasks.evaluate.scoring import LoglikScorer

    scorer = LoglikScorer(model, tokenizer, device, options.batch_size)
    if data.kind == "choice":
        summary, rows = _choice(scorer, data, options)
    elif data.kind == "greedy":
        summary, rows = _greedy(scorer, data)
    else:
        summary, rows = _generate(model, tokenizer, scorer.max_length, data, options, device)
    summary = {"format": data.format, "path": data.path, "n": len(rows), "records": data.records,
               "problems": data.problems, **summary}
    return summary, [{"task": data.name, **row} for row in rows]


def summarize(tasks: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """{"tasks": ..., "core": mean centred accuracy over the multiple-choice tasks}."""
    return {"tasks": dict(tasks), "core": metrics.core_score(tasks)}


def write_results(out: Path, payload: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write the per-item JSONL beside `out`, then `out` itself, each via a temporary file renamed
    into place: a results file present means both are complete. Returns the JSONL path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    items_path = out.with_name(out.stem + ".items.jsonl")
    _atomic_write(items_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    _atomic_write(out, json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return items_path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-" if value is None else str(value)


def format_table(summary: Mapping[str, Any]) -> str:
    """A plain-text table, one row per task, and the core score."""
    header = ("task", "format", "n", "acc", "±", "acc_norm", "centered", "other")
    lines = []
    for name, t in summary["tasks"].items():
        notes = [f"{k} {_fmt(t[k])}" for k in t if k == "perplexity" or k.startswith(("pass_at", "macro"))]
        left_out = {**t.get("problems", {}), **t.get("flagged", {})}
        if left_out:
            notes.append("left out: " + ", ".join(f"{k} {v}" for k, v in sorted(left_out.items())))
        other = ", ".join(notes)
        lines.append((name, t["format"], str(t["n"]), _fmt(t["acc"]), _fmt(t.get("acc_stderr")),
                      _fmt(t.get("acc_norm")), _fmt(t.get("centered_acc")), other))
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

    def render(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return "\n".join([render(header), *map(render, lines), f"core (mean centered accuracy): {_fmt(summary['core'])}"])


def load_tasks(paths: Sequence[str | Path], *, fmt: str | None = None, limit: int | None = None,
               delimiters: Mapping[str, str] | None = None) -> list[TaskData]:
    """Every file parsed (`load_task`), each mc file with the delimiter `delimiters` gives its
    task name, if any; EvalDataError when two files share a name or a delimiter names no file."""
    from gristmill.tasks.evaluate.formats import load_task, task_name

    delimiters = delimiters or {}
    names = [task_name(Path(path)) for path in paths]
    if len(set(names)) != len(names):
        raise EvalDataError(f"two task files share a name: {sorted(n for n in names if names.count(n) > 1)}")
    unknown = sorted(set(delimiters) - set(names))
    if unknown:
        raise EvalDataError(f"a delimiter is given for {unknown} but no task file has that name; "
                            f"task names: {names}")
    return [load_task(path, fmt, limit, delimiters.get(name)) for path, name in zip(paths, names)]


def evaluate_files(model_dir: Path, paths: Sequence[str | Path], out: Path, *, fmt: str | None = None,
                   limit: int | None = None, delimiters: Mapping[str, str] | None = None, device: str = "auto",
                   options: EvalOptions = EvalOptions(), warn: Any = print) -> dict[str, Any]:
    """`gristmill evaluate`: parse every file first (a bad one fails before the model loads),
    score each, write `out` and its per-item JSONL; returns the summary written."""
    from gristmill.model.loop import resolve_device

    datasets = load_tasks(paths, fmt=fmt, limit=limit, delimiters=delimiters)
    for data in datasets:
        if limit is not None and data.records < limit:
            warn(f"{data.path}: --limit {limit} but the file has {data.records} records; scoring all of them")
        if data.problems:
            warn(f"{data.path}: left out {sum(data.problems.values())} records: {data.problems}")
    device = resolve_device(device).type
    model, tokenizer = load_model(model_dir, device)
    tasks, rows = {}, []
    for data in datasets:
        tasks[data.name], task_rows = evaluate_task(model, tokenizer, data, options, device)
        rows += task_rows
    summary = {**summarize(tasks), "model": str(model_dir), "device": device, "limit": limit}
    write_results(out, summary, rows)
    return summary
