"""Items per second of gristmill's benchmark engine against lm-evaluation-harness on the same
model, items and device, log-likelihood tasks and generation (GSM8K) measured separately.

    python -m bench evaluate [--model DIR] [--items 40] [--gen-items 8] [--repeats 3] [--device cpu] [--smoke]

Without --model, a random Llama (hidden 256, 4 layers, a 4k BPE trained on tinyshakespeare) is
built in a temp dir. Both sides run in this process on one loaded copy of the tasks: ours via
`evaluate_task`, lm-eval via `simple_evaluate` with HFLM on the same directory and our YAMLs
(tasks/evaluate/lm_eval_tasks). lm-eval runs at its default batch size (1) and at ours. Timings
are medians over interleaved rounds, side by side, on one torch thread by default; the last line
is JSON with `ratio_vs_lmeval` (loglik, ours over lm-eval at its default), the same at equal batch
size, the generation ratio, and `items`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench import smoke
from bench.harness.runs import SHARED_DATA

REPO = Path(__file__).resolve().parents[1]
LOGLIK = {"hellaswag/hellaswag_val_part1.jsonl": "gristmill_hellaswag",
          "arc_easy/arc_easy_part1.jsonl": "gristmill_arc_easy",
          "winogrande/winogrande_part1.jsonl": "gristmill_winogrande",
          "lambada_openai/lambada_openai_part1.jsonl": "gristmill_lambada_openai"}
GENERATE = {"gsm8k/test_part1.jsonl": "gristmill_gsm8k"}
MAX_NEW_TOKENS = 32  # GSM8K generation budget on both sides (a random model never stops early)


def build_model(out: Path, data: Path) -> Path:
    import torch
    from transformers import AutoTokenizer

    from gristmill.model.export import export_model
    from gristmill.model.presets import ModelConfig
    from gristmill.model.presets import build_model as build
    from gristmill.tasks.tokenize.stage import save_tokenizer, train_tokenizer

    text = (data / "corpus" / "tinyshakespeare.txt").read_text()
    save_tokenizer(train_tokenizer([text[i:i + 2000] for i in range(0, 400_000, 2000)], vocab_size=4096), out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(0)
    model = build(ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688,
                              max_seq_len=1024), tokenizer)
    export_model(model, tokenizer, out)
    return out


def _interleaved_medians(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs taking turns in every round, so a load spike from
    elsewhere on the machine falls on all of them rather than on one."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def model_and_data_arguments(parser: argparse.ArgumentParser, items: int, items_help: str) -> None:
    """The arguments this benchmark shares with `bench fidelity`: the model, the data and how many items."""
    parser.add_argument("--model", type=Path, help="HF causal-LM dir (default: a random tiny Llama)")
    parser.add_argument("--data", type=Path, default=SHARED_DATA)
    parser.add_argument("--items", type=int, default=items, help=items_help)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench evaluate", description=__doc__.split("\n")[0])
    model_and_data_arguments(parser, 40, "items per log-likelihood task")
    parser.add_argument("--gen-items", type=int, default=8, help="GSM8K items")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both sides (1: steadier on a shared machine)")
    args = smoke.parse(parser, argv, items=1, gen_items=1, batch_size=2, repeats=1)
    import torch

    torch.set_num_threads(args.threads)

    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from gristmill.tasks.evaluate.engine import EvalOptions, evaluate_task, load_model
    from gristmill.tasks.evaluate.formats import load_task

    model_dir = args.model or build_model(Path(tempfile.mkdtemp(prefix="bench-eval-")), args.data)
    model, tokenizer = load_model(model_dir, args.device)
    options = EvalOptions(batch_size=args.batch_size, shots=5, max_new_tokens=MAX_NEW_TOKENS)
    manager = TaskManager(include_path=str(REPO / "tasks" / "evaluate" / "lm_eval_tasks"), include_defaults=False,
                          metadata={"eval_dir": str(args.data / "eval")})
    lms = {bs: HFLM(pretrained=str(model_dir), device=args.device, batch_size=bs)
           for bs in (1, args.batch_size)}

    def ours(files: dict[str, str], limit: int) -> None:
        for path in files:
            evaluate_task(model, tokenizer, load_task(args.data / "eval" / path, limit=limit), options, args.device)

    def theirs(files: dict[str, str], limit: int, bs: int) -> None:
        lm_eval.simple_evaluate(model=lms[bs], tasks=list(files.values()), task_manager=manager, limit=limit,
                                bootstrap_iters=0, gen_kwargs={"max_gen_toks": MAX_NEW_TOKENS})

    rows, figures = [], {}
    for kind, files, limit in (("loglik", LOGLIK, args.items), ("generate", GENERATE, args.gen_items)):
        items = limit * len(files)
        ours(files, limit)  # warm-up: first-call allocations and kernel choice
        medians = _interleaved_medians({"ours": partial(ours, files, limit),
                                        "lm1": partial(theirs, files, limit, 1),
                                        "lmb": partial(theirs, files, limit, args.batch_size)}, args.repeats)
        t_ours, t_lm1, t_lmb = medians["ours"], medians["lm1"], medians["lmb"]
        figures[kind] = {"items": items, "ours_items_per_s": items / t_ours, "lmeval_items_per_s": items / t_lm1,
                         "lmeval_same_batch_items_per_s": items / t_lmb}
        rows.append((kind, items, items / t_ours, items / t_lm1, items / t_lmb))
    print(f"model {model_dir} on {args.device} ({args.threads} threads); batch {args.batch_size}; "
          f"medians of {args.repeats} interleaved rounds")
    print(f"{'kind':<9}{'items':>6}{'gristmill it/s':>16}{'lm-eval bs=1':>14}{f'lm-eval bs={args.batch_size}':>15}")
    for kind, items, a, b, c in rows:
        print(f"{kind:<9}{items:>6}{a:>16.1f}{b:>14.1f}{c:>15.1f}")
    ll, gen = figures["loglik"], figures["generate"]
    print(json.dumps({
        "bench": "evaluate", "device": args.device, "threads": args.threads,
        "items": ll["items"], "gen_items": gen["items"],
        "ratio_vs_lmeval": round(ll["ours_items_per_s"] / ll["lmeval_items_per_s"], 2),
        "ratio_vs_lmeval_same_batch": round(ll["ours_items_per_s"] / ll["lmeval_same_batch_items_per_s"], 2),
        "generation_ratio_vs_lmeval": round(gen["ours_items_per_s"] / gen["lmeval_items_per_s"], 2),
        "generation_ratio_vs_lmeval_same_batch":
            round(gen["ours_items_per_s"] / gen["lmeval_same_batch_items_per_s"], 2),
        **{f"{kind}_{k}": round(v, 2) for kind, f in figures.items() for k, v in f.items() if k != "items"},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
