"""Evaluate stage: a report card comparing the base, SFT and aligned models.

For each model (inputs "pretrain", "sft", "align", labelled base / sft / aligned):

1. held-out perplexity and bits per byte on the tokenize stage's `tokens/val.bin`;
2. accuracy on generated arithmetic test problems (greedy chat generation, `core.arithmetic`);
3. optionally, multiple-choice tasks in the llm-foundry JSONL format `{"query", "choices", "gold"}`,
   scored by the summed log-likelihood of each choice given the query.

Writes `results.json` (nested by model) and `report.md` (a Markdown table base → SFT → aligned),
plus the align stage's own held-out measurements before and after alignment (its manifest stats:
preference accuracy and margin for DPO, greedy accuracy on held-out problems for GRPO).
Each model's results are also kept in `per_model/<label>.json` as it finishes, so a killed run
resumes with the next model.
"""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

import core.arithmetic as arithmetic
from core.chat import prompt_ids
from core.files import iter_jsonl
from core.stage import Engine, Manifest, StageResult
from core.units import bits_per_byte
from model.generate import generate_greedy
from tasks.evaluate.config import VERSION, Config, fingerprint  # noqa: F401 (the contract, re-exported)

log = logging.getLogger("gristmill.evaluate")

# Report label -> upstream stage whose `model/` is evaluated, in report column order.
MODELS = {"base": "pretrain", "sft": "sft", "aligned": "align"}


# --- perplexity and bits per byte ---------------------------------------------------------------

def eval_windows(n_tokens: int, seq_len: int, max_eval_tokens: int) -> tuple[int, int]:
    """(window length, number of windows): non-overlapping windows of `seq_len` predicted tokens,
    each needing one extra token of input; a val split shorter than one window gives one window
    over all of it."""
    window = min(seq_len, n_tokens - 1)
    if window < 1:
        raise ValueError(f"val split has {n_tokens} tokens; need at least 2")
    return window, max(1, min((n_tokens - 1) // window, max_eval_tokens // window))


def covered_bytes(val_bytes: int, val_tokens: int, tokens_evaluated: int) -> float:
    """UTF-8 bytes behind the evaluated tokens, assuming the evaluated prefix has the split's
    average bytes per token (windows start at the beginning of val.bin)."""
    return val_bytes * tokens_evaluated / val_tokens


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


def perplexity(model: Any, tokenize_dir: Path, config: Config, device: str) -> dict[str, float]:
    meta = json.loads((tokenize_dir / "tokens" / "meta.json").read_text())
    tokens = np.memmap(tokenize_dir / "tokens" / "val.bin", dtype=meta["dtype"], mode="r")
    window, n_windows = eval_windows(len(tokens), config.seq_len, config.max_eval_tokens)
    nll = sum_nll(model, tokens, window, n_windows, config.batch_size, device)
    n_eval = window * n_windows
    n_bytes = covered_bytes(meta["val_bytes"], meta["val_tokens"], n_eval)
    return {"val_loss": nll / n_eval, "val_ppl": math.exp(nll / n_eval),
            "val_bpb": bits_per_byte(nll / n_eval, n_bytes / n_eval), "val_tokens_evaluated": n_eval,
            "val_bytes_covered": n_bytes}


# --- arithmetic ---------------------------------------------------------------------------------

def arithmetic_accuracy(model: Any, tokenizer: Any, config: Config, device: str) -> dict[str, Any]:
    probs = arithmetic.problems("test", config.arith_problems, config.arith_seed)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": p.question}]) for p in probs]
    completions = generate_greedy(model, tokenizer, prompts, config.max_new_tokens, device, config.batch_size)
    correct = [arithmetic.is_correct(c, p) for c, p in zip(completions, probs)]
    examples = [{"question": p.question, "answer": p.answer, "completion": c}
                for p, c in list(zip(probs, completions))[:5]]
    return {"arith_acc": sum(correct) / len(correct), "arith_n": len(correct), "arith_examples": examples}


# --- multiple choice ----------------------------------------------------------------------------

LoglikFn = Callable[[str, Sequence[str]], list[float]]


def load_mc_items(path: Path | str, max_items: int) -> list[dict[str, Any]]:
    items = []
    for item in iter_jsonl([path]):
        if len(items) >= max_items:
            break
        if not 0 <= item["gold"] < len(item["choices"]):
            raise ValueError(f"{path}: gold {item['gold']} out of range in {item['query']!r}")
        items.append(item)
    return items


def score_mc(items: Sequence[dict[str, Any]], loglik: LoglikFn, delimiter: str) -> dict[str, float]:
    """Accuracy of picking the choice with the highest log-likelihood, and the chance level."""
    correct = 0
    for item in items:
        scores = loglik(item["query"] + delimiter, item["choices"])
        correct += int(np.argmax(scores)) == item["gold"]
    chance = float(np.mean([1 / len(item["choices"]) for item in items]))
    return {"acc": correct / len(items), "n": len(items), "chance": chance}


def split_context(context: str, continuation: str) -> tuple[str, str]:
    """Move the context's trailing spaces onto the continuation, so a byte-level BPE sees
    " Paris" as it would in running text rather than a lone space token."""
    stripped = context.rstrip(" ")
    return stripped, context[len(stripped):] + continuation


def model_loglik(model: Any, tokenizer: Any, device: str) -> LoglikFn:
    """A `LoglikFn` summing the model's log-probabilities of each continuation's tokens."""
    import torch

    max_len = model.config.max_position_embeddings

    def loglik(context: str, continuations: Sequence[str]) -> list[float]:
        seqs, n_conts = [], []
        for cont in continuations:
            ctx_text, cont_text = split_context(context, cont)
            ctx = tokenizer.encode(ctx_text, add_special_tokens=False)
            cont_ids = tokenizer.encode(cont_text, add_special_tokens=False)
            seqs.append((ctx + cont_ids)[-(max_len + 1):])  # keep the continuation, trim the context
            n_conts.append(len(cont_ids))
        width = max(len(s) for s in seqs) - 1
        ids = torch.tensor([s[:-1] + [tokenizer.pad_token_id] * (width + 1 - len(s)) for s in seqs],
                           device=device)
        mask = (torch.arange(width, device=device)[None, :] <
                torch.tensor([len(s) - 1 for s in seqs], device=device)[:, None]).long()
        with torch.no_grad():
            logprobs = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        out = []
        for row, (seq, n) in enumerate(zip(seqs, n_conts)):
            positions = torch.arange(len(seq) - 1 - n, len(seq) - 1, device=device)
            targets = torch.tensor(seq[-n:], device=device)
            out.append(logprobs[row, positions, targets].sum().item())
        return out

    return loglik


def task_name(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", Path(path).name.removesuffix(".jsonl").lower()).strip("_")


# --- per model ----------------------------------------------------------------------------------

def load_model(model_dir: Path, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # float32 everywhere so CPU and GPU results agree up to kernel rounding.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    return model, tokenizer


def evaluate_model(model_dir: Path, tokenize_dir: Path, config: Config, device: str) -> dict[str, Any]:
    model, tokenizer = load_model(model_dir, device)
    meta = json.loads((tokenize_dir / "tokens" / "meta.json").read_text())
    if len(tokenizer) != meta["vocab_size"]:
        raise ValueError(f"{model_dir}: tokenizer has {len(tokenizer)} tokens but the val split "
                         f"was encoded with vocab_size {meta['vocab_size']}")
    if config.seq_len > model.config.max_position_embeddings:
        raise ValueError(f"seq_len={config.seq_len} exceeds the model's max positions "
                         f"({model.config.max_position_embeddings}) in {model_dir}")
    results: dict[str, Any] = perplexity(model, tokenize_dir, config, device)
    results.update(arithmetic_accuracy(model, tokenizer, config, device))
    loglik = model_loglik(model, tokenizer, device)
    results["mc"] = {task_name(path): score_mc(load_mc_items(path, config.mc_max_items),
                                               loglik, config.mc_delimiter)
                     for path in config.mc_tasks}
    return results


def flat_stats(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """`{label}_{metric}` for every numeric result, e.g. base_val_bpb, aligned_mc_arc_easy_acc."""
    stats: dict[str, float] = {}
    for label, res in results.items():
        for key, value in res.items():
            if isinstance(value, (int, float)):
                stats[f"{label}_{key}"] = value
        for task, scores in res.get("mc", {}).items():
            for key, value in scores.items():
                stats[f"{label}_mc_{task}_{key}"] = value
    return stats


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


def alignment_lines(summary: Mapping[str, Any]) -> list[str]:
    if not summary:
        return []
    items = [f"{summary[k]} held-out {k.split('_')[0]}" for k in ALIGN_COUNTS[:2] if k in summary]
    items += [f"{summary['steps']} alignment steps"] if "steps" in summary else []
    lines = ["", f"## Alignment ({summary['method']}, measured by the align stage on held-out data)", "",
             "| metric | before (SFT) | after (aligned) | change |", "|---|---:|---:|---:|"]
    for metric, v in summary["heldout"].items():
        lines.append(f"| {metric.replace('_', ' ')} | {v['before']:.4f} | {v['after']:.4f} | "
                     f"{v['after'] - v['before']:+.4f} |")
    return lines + (["", "Measured on " + ", ".join(items) + "."] if items else [])


# --- report -------------------------------------------------------------------------------------

def _row(name: str, values: list[float], items: Any, fmt: str = "{:.4f}") -> str:
    return "| " + " | ".join([name, *[fmt.format(v) for v in values], str(items)]) + " |"


def render_report(results: Mapping[str, Mapping[str, Any]], upstream: Mapping[str, str],
                  device: str, alignment: Mapping[str, Any] | None = None) -> str:
    labels = list(results)
    first = results[labels[0]]
    col = lambda key: [results[label][key] for label in labels]  # noqa: E731
    lines = ["# Evaluation report", "",
             "| metric | " + " | ".join(labels) + " | items |",
             "|---|" + "---:|" * len(labels) + "---:|",
             _row("val perplexity ↓", col("val_ppl"), f"{first['val_tokens_evaluated']} tokens", "{:.2f}"),
             _row("val bits per byte ↓", col("val_bpb"), f"{first['val_bytes_covered']:.0f} bytes"),
             _row("val loss (nats/token) ↓", col("val_loss"), f"{first['val_tokens_evaluated']} tokens"),
             _row("arithmetic accuracy ↑", col("arith_acc"), f"{first['arith_n']} problems", "{:.3f}")]
    for task, scores in first["mc"].items():
        accs = [results[label]["mc"][task]["acc"] for label in labels]
        lines.append(_row(f"{task} accuracy ↑ (chance {scores['chance']:.3f})", accs,
                          f"{scores['n']} items", "{:.3f}"))
    lines += ["", "Bits per byte: total NLL (nats) / (ln 2 × bytes), where bytes = the val split's "
              "UTF-8 bytes × (tokens evaluated / val tokens); document separators count as tokens "
              "but add no bytes."]
    lines += alignment_lines(alignment or {})
    lines += ["", f"Device: {device}.", "", "## Upstream artifacts", ""]
    lines += [f"- {name}: `{key}`" for name, key in upstream.items()]
    return "\n".join(lines) + "\n"


# --- stage --------------------------------------------------------------------------------------

def run(config: Config, inputs: Mapping[str, Manifest], out_dir: Path, *, engine: Engine) -> StageResult:
    from model.loop import resolve_device

    out_dir = Path(out_dir)
    device = resolve_device(config.device).type
    tokenize_dir = Path(inputs["tokenize"].path)
    per_model = out_dir / "per_model"
    per_model.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for label, stage in MODELS.items():
        done = per_model / f"{label}.json"
        if done.exists():  # finished before a crash; same config, so the same result
            results[label] = json.loads(done.read_text())
            continue
        log.info("evaluating %s (%s) on %s", label, inputs[stage].key, device)
        results[label] = evaluate_model(Path(inputs[stage].path) / "model", tokenize_dir, config, device)
        done.write_text(json.dumps(results[label], indent=2, sort_keys=True))
        log.info("%s: ppl %.2f bpb %.4f arith %.3f", label, results[label]["val_ppl"],
                 results[label]["val_bpb"], results[label]["arith_acc"])

    upstream = {name: inputs[name].key for name in ("tokenize", *MODELS.values())}
    alignment = alignment_summary(inputs["align"].stats)
    payload = {"models": results, "alignment": alignment, "upstream": upstream, "device": device}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    (out_dir / "report.md").write_text(render_report(results, upstream, device, alignment))
    stats = flat_stats(results)
    for metric, values in alignment.get("heldout", {}).items():
        stats.update({f"align_heldout_{metric}_{when}": v for when, v in values.items()})
    return StageResult(stats=stats, artifacts=["report.md", "results.json"])
