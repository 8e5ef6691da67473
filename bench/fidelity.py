"""gristmill's benchmark scores against lm-evaluation-harness's own standard tasks on the shared
files, and the effect of each difference: the ones this engine removed and the ones that remain.

    python -m bench fidelity [--model DIR] [--items 50] [--device cpu] [--smoke]

The files are converted to each standard task's schema (tasks/evaluate/lm_eval_tasks/standard.py)
and lm-eval 0.4.13 runs its own task definitions on them, in this process, offline. Each row sets
one scoring (gristmill, or lm-eval on differently converted text) against another on the first
`--items` records: accuracy of both, items whose prediction differs, and the largest difference
of a per-choice log-likelihood (nats). Rows:

- every standard task as gristmill scores it (expected: no item differs, Δ < 1e-4);
- COPA scored with gristmill's former delimiter ("\\nAnswer: ") and with llm-foundry's (one space)
  against lm-eval's copa;
- lm-eval's copa and boolq on the original text against the text in llm-foundry's files (its
  comma before the connective; its "Passage: " label): what that rendering changes;
- HellaSwag: gristmill (`ctx` as the file has it) against lm-eval's hellaswag (its preprocessing).

Without --model, the Llama of `bench evaluate` (hidden 256, 4 layers, 4k BPE), trained for
`--train-steps` AdamW steps on the shared English text (0: left random) so its log-likelihoods
react to words and punctuation; it still sits near chance on these tasks, so the rows measure how
much each difference moves scores, not a strong model's accuracy. The last line is JSON with
every row.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import smoke
from bench.evaluate import build_model, model_and_data_arguments

FILES = {"copa": "copa/copa_part1.jsonl", "boolq": "boolq/boolq_part1.jsonl", "piqa": "piqa/valid_part1.jsonl",
         "winogrande": "winogrande/winogrande_part1.jsonl",
         "lambada_openai": "lambada_openai/lambada_openai_part1.jsonl", "arc_easy": "arc_easy/arc_easy_part1.jsonl",
         "mmlu": "mmlu_redux/mmlu_redux_part1.jsonl",
         "hellaswag": "hellaswag/hellaswag_val_part1.jsonl"}


def pretrain(model_dir: Path, data: Path, steps: int, seq_len: int = 256, batch_size: int = 8) -> float:
    """`steps` AdamW steps (lr 1e-3) on random windows of the shared English corpora; saves the
    model over itself and returns the last step's loss (nats per token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = data / "corpus"
    files = [corpus / "tinyshakespeare.txt", corpus / "botchan_en.txt",
             *sorted((corpus / "nltk_state_union").glob("*.txt"))]
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    ids = torch.tensor(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator).tolist()
        batch = torch.stack([ids[s:s + seq_len] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)
    return loss.item()


def _without_comma(doc: dict[str, Any]) -> dict[str, Any]:
    """COPA's premise as the original has it: llm-foundry wrote "<premise stem>, therefore"."""
    return {**doc, "premise": doc["premise"].removesuffix(",.") + "."}


def _without_label(doc: dict[str, Any]) -> dict[str, Any]:
    """BoolQ's passage as the original has it: llm-foundry prefixed "Passage: "."""
    return {**doc, "passage": doc["passage"].removeprefix("Passage: ")}


# lm-eval's own tasks on another conversion: derived name -> (task, doc edit)
VARIANTS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "copa_original_premise": ("copa", _without_comma), "boolq_original_passage": ("boolq", _without_label)}
Scores = list[tuple[list[float], float]]  # per item: per-choice log-likelihoods, acc


def compare(name: str, a: Scores, b: Scores) -> dict[str, Any]:
    """Accuracies of both, items whose prediction (argmax; one-request items: the greedy flag)
    differs, the largest per-choice |Δ log-likelihood|."""
    assert len(a) == len(b), name

    def pred(lls: list[float], acc: float) -> float:
        return max(range(len(lls)), key=lls.__getitem__) if len(lls) > 1 else acc

    return {"row": name, "items": len(a),
            "acc_a": sum(x for _, x in a) / len(a), "acc_b": sum(x for _, x in b) / len(b),
            "predictions_differ": sum(pred(*x) != pred(*y) for x, y in zip(a, b)),
            "max_abs_dloglik": max(abs(p - q) for (x, _), (y, _) in zip(a, b) for p, q in zip(x, y))}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench fidelity", description=__doc__.split("\n")[0])
    model_and_data_arguments(parser, 50, "first records of each file")
    parser.add_argument("--train-steps", type=int, default=300, help="training of the default model (0: random)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    # 3 items: MMLU's first two records are flagged, and a task with no item left is refused
    args = smoke.parse(parser, argv, items=3, train_steps=1)
    import torch

    torch.set_num_threads(args.threads)
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from gristmill.tasks.evaluate.engine import EvalOptions, evaluate_task, load_model
    from gristmill.tasks.evaluate.formats import load_task, piqa_labels_path, read_records
    from gristmill.tasks.evaluate.lm_eval_tasks.standard import convert, write_task

    model_dir, trained = args.model, ""
    if model_dir is None:
        model_dir = build_model(Path(tempfile.mkdtemp(prefix="bench-fidelity-")), args.data)
        trained = f", trained {args.train_steps} steps to loss {pretrain(model_dir, args.data, args.train_steps):.2f}"
    model, tokenizer = load_model(model_dir, args.device)
    paths = {task: args.data / "eval" / path for task, path in FILES.items()}
    out = Path(tempfile.mkdtemp(prefix="bench-fidelity-tasks-"))

    def ours(task: str, **load: Any) -> tuple[Scores, list[int]]:
        rows = evaluate_task(model, tokenizer, load_task(paths[task], limit=args.items, **load),
                             EvalOptions(), args.device)[1]
        return [(r["loglik"], float(r["correct"])) for r in rows], [r["id"] for r in rows]

    gristmill: dict[str, Scores] = {}
    docs: dict[str, list[dict[str, Any]]] = {}
    subjects: list[str] = []
    for task, path in paths.items():
        gristmill[task], ids = ours(task)
        records = read_records(path, args.items)
        if task == "piqa":
            records = [{**r, "label": label} for r, label in zip(records, piqa_labels_path(path).read_text().split())]
        if task == "mmlu":  # lm-eval has a task per subject, each with its subject line
            subjects = list(dict.fromkeys(records[i]["subject"] for i in ids))  # the file's order
            for subject in subjects:
                chosen = [records[i] for i in ids if records[i]["subject"] == subject]
                write_task(f"mmlu_{subject}", convert(f"mmlu_{subject}", chosen), out)
            continue
        docs[task] = convert(task, [records[i] for i in ids])
        write_task(task, docs[task], out)
    for name, (task, edit) in VARIANTS.items():
        write_task(task, [edit(d) for d in docs[task]], out, name=name)
    manager = TaskManager(include_path=str(out), include_defaults=False)
    samples = lm_eval.simple_evaluate(model=HFLM(pretrained=str(model_dir), device=args.device, batch_size=1),
                                      tasks=[*FILES.keys() - {"mmlu"}, *(f"mmlu_{s}" for s in subjects), *VARIANTS],
                                      limit=None, log_samples=True, bootstrap_iters=0,
                                      task_manager=manager)["samples"]
    lm = {task: [([r[0][0] for r in s["resps"]], s["acc"]) for s in sorted(ss, key=lambda s: s["doc_id"])]
          for task, ss in samples.items()}
    lm["mmlu"] = [score for subject in subjects for score in lm[f"mmlu_{subject}"]]

    rows = [compare(f"{task}: gristmill vs lm-eval", gristmill[task], lm[task]) for task in FILES]
    for label, delimiter in (('"\\nAnswer: " (before)', "\nAnswer: "), ('" " (llm-foundry)', " ")):
        rows.append(compare(f"copa: gristmill, delimiter {label} vs lm-eval", ours("copa", delimiter=delimiter)[0],
                            lm["copa"]))
    for name, (task, _) in VARIANTS.items():
        rows.append(compare(f"{task}: lm-eval, file's text vs {name.split('_', 1)[1].replace('_', ' ')}",
                            lm[task], lm[name]))
    print(f"model {model_dir}{trained} on {args.device}; first {args.items} records of each file")
    print(f"{'comparison (a vs b)':<52}{'n':>4}{'acc a':>7}{'acc b':>7}{'pred≠':>6}{'max|Δll|':>10}")
    for r in rows:
        print(f"{r['row']:<52}{r['items']:>4}{r['acc_a']:>7.3f}{r['acc_b']:>7.3f}{r['predictions_differ']:>6}"
              f"{r['max_abs_dloglik']:>10.4f}")
    print(json.dumps({"bench": "fidelity", "items": args.items, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
