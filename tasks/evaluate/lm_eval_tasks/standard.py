"""lm-evaluation-harness's own standard tasks (copa, boolq, piqa, winogrande, lambada_openai,
arc_easy, arc_challenge, mmlu_<subject>, hellaswag) on gristmill's benchmark files, offline.

Each file's records are converted to the schema the standard task reads (`CONVERT`) and written as
local JSONL; a derived YAML `include:`s the task's own YAML from the installed lm_eval package and
replaces only where the data comes from (`dataset_path: json` + `data_files`) and which split is
scored, so lm-eval's own doc_to_text, doc_to_choice, target_delimiter and description build the
prompts:

    from gristmill.tasks.evaluate.lm_eval_tasks.standard import write_task
    write_task("copa", records, out_dir)  # then lm_eval --include_path out_dir --tasks copa

The conversions invert the task's prompt template, so lm-eval renders the text the file holds
(BoolQ's "Passage: " label and COPA's comma before the connective included: they are in
llm-foundry's files, not added by either scorer). HellaSwag's file keeps only the activity label
and `ctx`, so ctx_a / ctx_b are a reconstruction (`hellaswag_doc`); lm-eval's hellaswag then
preprocesses them, which gristmill does not (docs/evaluation.md measures the effect).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]


def copa_doc(r: Doc) -> Doc:
    """llm-foundry {query: "<premise stem> because|therefore", choices, gold} → SuperGLUE COPA.
    lm-eval drops the premise's last character (its period) and appends the connective."""
    stem, connective = r["query"].rsplit(" ", 1)
    return {"premise": stem + ".", "question": {"because": "cause", "therefore": "effect"}[connective],
            "choice1": r["choices"][0], "choice2": r["choices"][1], "label": r["gold"]}


def boolq_doc(r: Doc) -> Doc:
    """llm-foundry {query: "Passage: P\\nQuestion: Q?", choices: [no, yes], gold} → SuperGLUE
    BoolQ, whose prompt is "{passage}\\nQuestion: {question}?\\nAnswer:"."""
    passage, _, question = r["query"].rpartition("\nQuestion: ")
    return {"passage": passage, "question": question.removesuffix("?"), "label": r["gold"]}


def piqa_doc(r: Doc) -> Doc:
    """PIQA's own schema; `label` is the line of the labels file beside it (added by the caller)."""
    return {"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(r["label"])}


def winogrande_doc(r: Doc) -> Doc:
    """llm-foundry {context_options, continuation, gold} → WinoGrande {sentence with "_", option1,
    option2, answer "1"|"2"}: the options' common prefix, "_", then the continuation."""
    first, second = r["context_options"]
    n = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    return {"sentence": f"{first[:n]}_ {r['continuation'].strip()}", "option1": first[n:],
            "option2": second[n:], "answer": str(r["gold"] + 1)}


def lambada_doc(r: Doc) -> Doc:
    """lm-eval's lambada_openai splits `text` at its last space: context, then " <last word>"."""
    return {"text": f"{r['context']} {r['continuation']}"}


def arc_doc(r: Doc) -> Doc:
    """llm-foundry {query: "Question: Q", choices, gold} → AI2 ARC {question, choices{text, label},
    answerKey}."""
    labels = [chr(ord("A") + i) for i in range(len(r["choices"]))]
    return {"question": r["query"].removeprefix("Question: "), "choices": {"text": r["choices"], "label": labels},
            "answerKey": labels[r["gold"]]}


def mmlu_doc(r: Doc) -> Doc:
    return {"question": r["question"], "subject": r["subject"], "choices": r["choices"], "answer": r["answer"]}


def hellaswag_doc(r: Doc) -> Doc:
    """{ctx: "<activity_label>: <ctx>", endings, label} → HellaSwag's fields. The original ctx is
    ctx_a + " " + ctx_b; ActivityNet's ctx_b is the lowercase start of the last sentence, so the
    fragment after the last ". " is taken as ctx_b when it starts lowercase (lm-eval capitalises it)."""
    label, _, ctx = r["ctx"].partition(": ")
    ctx_a, sep, ctx_b = ctx.rpartition(". ")
    if sep and ctx_b[:1].islower():
        ctx_a += "."
    else:
        ctx_a, ctx_b = ctx, ""
    return {"activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b, "endings": r["endings"],
            "label": str(r["label"])}


# lm-eval task -> (its YAML under lm_eval/tasks, converter of one gristmill record)
CONVERT: dict[str, tuple[str, Callable[[Doc], Doc]]] = {
    "copa": ("super_glue/copa/default.yaml", copa_doc),
    "boolq": ("super_glue/boolq/default.yaml", boolq_doc),
    "piqa": ("piqa/piqa.yaml", piqa_doc),
    "winogrande": ("winogrande/default.yaml", winogrande_doc),
    "lambada_openai": ("lambada/lambada_openai.yaml", lambada_doc),
    "arc_easy": ("arc/arc_easy.yaml", arc_doc),
    "arc_challenge": ("arc/arc_challenge.yaml", arc_doc),
    "hellaswag": ("hellaswag/hellaswag.yaml", hellaswag_doc),
}
MMLU_YAML = "mmlu/default/mmlu_{}.yaml"


def task_yaml(task: str) -> Path:
    """The installed lm_eval package's YAML of a standard task (mmlu_<subject> included)."""
    spec = find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise ImportError("lm-eval is not installed: pip install 'lm-eval==0.4.13'")
    relative = MMLU_YAML.format(task.removeprefix("mmlu_")) if task.startswith("mmlu_") else CONVERT[task][0]
    return Path(spec.origin).parent / "tasks" / relative


def convert(task: str, records: Iterable[Doc]) -> list[Doc]:
    """Records of a gristmill file as docs of lm-eval's `task`."""
    to_doc = mmlu_doc if task.startswith("mmlu_") else CONVERT[task][1]
    return [to_doc(r) for r in records]


def write_task(task: str, docs: list[Doc], out_dir: Path, name: str | None = None) -> Path:
    """`<name>.jsonl` (the docs) and `<name>.yaml` in `out_dir`: lm-eval's own definition of `task`
    (`name`: the derived task's name, `task` by default), reading the docs as its only (test)
    split; returns the YAML's path. Point a TaskManager's include_path at `out_dir`
    (include_defaults=False keeps it fast) and ask for `name`."""
    name = name or task
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"{name!r} is not an lm-eval task name")
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    derived = {"include": str(task_yaml(task)), "task": name, "dataset_path": "json", "dataset_name": None,
               # HF datasets caches even local files; keep that cache beside them, not in $HOME
               "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(out_dir / ".hf_cache")},
               # one split: no training or few-shot split is read (every check here is zero-shot)
               "training_split": None, "validation_split": None, "fewshot_split": None, "test_split": "test"}
    path = out_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(derived, sort_keys=False))
    return path
