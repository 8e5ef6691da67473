"""Benchmark file formats: each turns one JSONL record into the requests a model answers.

A format is recognised from the fields of a file's first record (`detect`), or forced by name.
Every format builds its prompts exactly as lm-evaluation-harness's own task for the benchmark
does (and as the YAML of the same name in `lm_eval_tasks/`), so scores can be checked item by
item against lm-eval:

| format     | fields                                   | context → continuation                          |
|------------|------------------------------------------|-------------------------------------------------|
| mc         | query, choices, gold (llm-foundry)       | `query + delimiter` → `choice` (below)           |
| hellaswag  | ctx, endings, label                      | `ctx` → `" " + ending`                           |
| mmlu       | question, choices, answer (+subject, error_type: MMLU-Redux) | lm-eval's MMLU prompt → `" A"`… |
| piqa       | goal, sol1, sol2 (+ labels file beside)  | `"Question: " + goal + "\\nAnswer:"` → `" " + sol` |
| winogrande | context_options, continuation, gold      | each option → `" " + continuation` (partial scoring) |
| lambada    | context, continuation                    | `context` → `" " + continuation` (greedy match)  |
| gsm8k      | question, answer (`#### n`)              | few-shot prompt → generated answer               |

An llm-foundry multiple-choice file is scored with the delimiter its benchmark's standard task
puts between query and choice (`MC_DELIMITERS`, the benchmark recognised from the file's name):
`"\\nAnswer: "` after a question (ARC, BoolQ, MMLU, PIQA), two spaces for COPA (lm-eval's copa), a
space otherwise (OpenBookQA, HellaSwag; llm-foundry's default). A delimiter given for the file
overrides it.

A record that cannot be scored (gold out of range, a field missing, an unparsable answer) is a
*problem*: counted by reason and shown, never silently scored.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gristmill.core.files import JsonLinesError, iter_jsonl

Kind = Literal["choice", "greedy", "generate"]


class EvalDataError(ValueError):
    """A benchmark file that cannot be evaluated; the message names the file."""


@dataclass(frozen=True, kw_only=True)
class Item:
    """One benchmark question, as requests to a model.

    `requests` are (context, continuation) pairs scored by log-likelihood: one per choice for
    "choice" items, one for "greedy" items (LAMBADA); "generate" items have a `prompt` instead.
    `norm_chars` are lm-eval's acc_norm lengths: characters of each choice's text."""

    index: int  # 0-based position in the file (after --limit, the first N records)
    kind: Kind
    gold: int | str
    requests: tuple[tuple[str, str], ...] = ()
    norm_chars: tuple[int, ...] = ()
    prompt: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class TaskData:
    """A benchmark file, parsed: the items to score and the records that could not be."""

    name: str
    path: str
    format: str
    kind: Kind
    items: list[Item]
    problems: dict[str, int]  # reason -> count of records left out
    records: int  # records read (the first --limit of the file)


ANSWER = "\nAnswer:"
LETTERS = "ABCDEFGHIJ"
# Text between an llm-foundry file's query and each choice (llm-foundry's continuation_delimiter;
# trailing whitespace goes onto the choice, as lm-eval scores " choice"), per benchmark as its
# standard scorer has it: "\nAnswer: " after a question (llm-foundry's tasks_v0.3.yaml and lm-eval's
# arc, boolq, mmlu, piqa); for COPA two spaces, as lm-eval's copa scores (its choices start with a
# space and its target_delimiter adds another; llm-foundry's copa has one). Any other file gets
# llm-foundry's default, a space (lm-eval's openbookqa and hellaswag too).
MC_DELIMITERS = {"arc_easy": ANSWER + " ", "arc_challenge": ANSWER + " ", "boolq": ANSWER + " ",
                 "mmlu": ANSWER + " ", "piqa": ANSWER + " ", "copa": "  "}
DEFAULT_MC_DELIMITER = " "
# MMLU's task description, as lm-eval's mmlu_<subject> tasks open every prompt
MMLU_SUBJECT_LINE = "The following are multiple choice questions (with answers) about {}.\n\n"


class ItemProblem(ValueError):
    """One record that cannot be scored; its message is a snake_case reason."""


def _choice_item(index: int, context: str, choices: list[Any], gold: Any, space: str = " ",
                 **meta: Any) -> Item:
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
        raise ItemProblem("bad_choices")
    if isinstance(gold, str) and gold.strip().lstrip("-").isdigit():
        gold = int(gold)
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise ItemProblem("gold_out_of_range")
    return Item(index=index, kind="choice", gold=gold, requests=tuple((context, space + c) for c in choices),
                norm_chars=tuple(len(c) for c in choices), meta=meta)


def _mc(index: int, r: dict[str, Any], delimiter: str) -> Item:
    head = delimiter.rstrip()  # the delimiter's trailing whitespace opens the continuation
    return _choice_item(index, r["query"] + head, r["choices"], r["gold"], space=delimiter[len(head):])


def _hellaswag(index: int, r: dict[str, Any], _: Any) -> Item:
    return _choice_item(index, r["ctx"], r["endings"], r["label"])


def mmlu_prompt(question: str, choices: list[str], subject: str = "") -> str:
    """lm-eval's MMLU prompt: its subject line (when the subject is known), the question,
    lettered choices, then "Answer:"."""
    lines = [question.strip()] + [f"{LETTERS[i]}. {c}" for i, c in enumerate(choices)]
    description = MMLU_SUBJECT_LINE.format(subject.replace("_", " ")) if subject else ""
    return description + "\n".join(lines) + ANSWER


def _mmlu(index: int, r: dict[str, Any], _: Any) -> Item:
    choices = r["choices"]
    if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
        raise ItemProblem("bad_choices")
    subject = r.get("subject", "")
    return _choice_item(index, mmlu_prompt(r["question"], choices, subject), list(LETTERS[:len(choices)]),
                        r["answer"], subject=subject, error_type=r.get("error_type", "ok"))


def _piqa(index: int, r: dict[str, Any], labels: list[str] | None) -> Item:
    if labels is None or index >= len(labels):
        raise ItemProblem("missing_label")
    return _choice_item(index, f"Question: {r['goal']}{ANSWER}", [r["sol1"], r["sol2"]], labels[index])


def _winogrande(index: int, r: dict[str, Any], _: Any) -> Item:
    options, gold = r["context_options"], r["gold"]
    if not isinstance(options, list) or len(options) < 2:
        raise ItemProblem("bad_choices")
    if not isinstance(gold, int) or not 0 <= gold < len(options):
        raise ItemProblem("gold_out_of_range")
    continuation = " " + r["continuation"].strip()
    # lm-eval's partial scoring: every option is a context, the shared continuation is scored.
    return Item(index=index, kind="choice", gold=gold, requests=tuple((o, continuation) for o in options),
                norm_chars=tuple(len(continuation) for _ in options))


def _lambada(index: int, r: dict[str, Any], _: Any) -> Item:
    if not r["continuation"]:
        raise ItemProblem("empty_continuation")
    return Item(index=index, kind="greedy", gold=r["continuation"],
                requests=((r["context"], " " + r["continuation"]),))


GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)\s*$")


def gsm8k_gold(answer: str) -> str:
    """The number after `####`, commas removed (ItemProblem when there is none)."""
    match = GSM8K_ANSWER.search(answer.strip())
    if not match:
        raise ItemProblem("unparsable_answer")
    return match[1].replace(",", "").rstrip(".")


def _gsm8k(index: int, r: dict[str, Any], _: Any) -> Item:
    return Item(index=index, kind="generate", gold=gsm8k_gold(r["answer"]), prompt=r["question"])


Parser = Callable[[int, dict[str, Any], Any], Item]
# name -> (fields that identify it, kind, parser); detection tries them in this order.
FORMATS: dict[str, tuple[frozenset[str], Kind, Parser]] = {
    "winogrande": (frozenset({"context_options", "continuation", "gold"}), "choice", _winogrande),
    "mmlu": (frozenset({"question", "choices", "answer"}), "choice", _mmlu),
    "hellaswag": (frozenset({"ctx", "endings", "label"}), "choice", _hellaswag),
    "piqa": (frozenset({"goal", "sol1", "sol2"}), "choice", _piqa),
    "mc": (frozenset({"query", "choices", "gold"}), "choice", _mc),
    "lambada": (frozenset({"context", "continuation"}), "greedy", _lambada),
    "gsm8k": (frozenset({"question", "answer"}), "generate", _gsm8k),
}


def detect(fields: set[str], path: str) -> str:
    """The first format whose identifying fields the record has."""
    for name, (needed, _, _) in FORMATS.items():
        if needed <= fields:
            return name
    known = "; ".join(f"{n}: {', '.join(sorted(f))}" for n, (f, _, _) in FORMATS.items())
    raise EvalDataError(f"{path}: unrecognised benchmark format; found fields {sorted(fields)}, "
                        f"expected one of: {known}")


def piqa_labels_path(path: Path) -> Path:
    """PIQA's labels sit beside the questions: valid.jsonl → valid-labels.lst (and _partN suffixes)."""
    return path.with_name(path.name.replace("valid", "valid-labels", 1)).with_suffix(".lst")


def read_records(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The first `limit` records of a benchmark file (None: all); EvalDataError naming the file
    and line of one that is not a JSON object."""
    try:
        return list(itertools.islice(iter_jsonl([path], objects_only=True), limit))
    except JsonLinesError as error:
        raise EvalDataError(str(error)) from None


SPLIT_NAMES = ("valid", "val", "test", "train", "dev")


def task_name(path: Path) -> str:
    """A short name from the file name (hellaswag_val_part1.jsonl → hellaswag_val_part1), with
    the folder's in front when the file is named after a split (gsm8k/test.jsonl → gsm8k_test)."""
    stem = path.name.split(".")[0]
    if stem.lower().startswith(SPLIT_NAMES) and path.parent.name:
        stem = f"{path.parent.name}_{stem}"
    return re.sub(r"[^a-z0-9]+", "_", stem.lower()).strip("_")


def foundry_task(path: Path) -> str | None:
    """The llm-foundry task (a key of MC_DELIMITERS) a file is, from its name or its folder's:
    copa_part1.jsonl, copa/test.jsonl and openbook_qa.jsonl are copa, copa and openbook_qa."""
    for name in (task_name(path), path.parent.name.lower()):
        for task in MC_DELIMITERS:
            if name == task or name.startswith(task + "_"):
                return task
    return None


def mc_delimiter(path: Path, delimiter: str | None = None) -> str:
    """The delimiter an llm-foundry multiple-choice file is scored with: the one given, else its
    task's, else llm-foundry's default."""
    if delimiter is not None:
        return delimiter
    return MC_DELIMITERS.get(foundry_task(path) or "", DEFAULT_MC_DELIMITER)


def load_task(path: str | Path, fmt: str | None = None, limit: int | None = None,
              delimiter: str | None = None) -> TaskData:
    """Parse the first `limit` records of a benchmark file (all when None) into items; an mc
    file's `delimiter` (None: its task's, `mc_delimiter`) goes between query and choice.

    EvalDataError naming the file when it is missing, empty, of no known format, or has no
    scorable record, or when a delimiter is given for a file of another format; records that
    cannot be scored are counted in `problems`."""
    path = Path(path)
    if not path.is_file():
        raise EvalDataError(f"{path}: no such benchmark file")
    records = read_records(path, limit)
    if not records:
        raise EvalDataError(f"{path}: no records (empty file)")
    if fmt is not None and fmt not in FORMATS:
        raise EvalDataError(f"{path}: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    fmt = fmt or detect(set(records[0]), str(path))
    needed, kind, parse = FORMATS[fmt]
    if delimiter is not None and fmt != "mc":
        raise EvalDataError(f"{path}: a delimiter was given but this is a {fmt} file; "
                            "only mc files (query, choices, gold) take one")
    extra: Any = mc_delimiter(path, delimiter) if fmt == "mc" else None
    if fmt == "piqa":
        labels_path = piqa_labels_path(path)
        if not labels_path.is_file():
            raise EvalDataError(f"{path}: PIQA labels file {labels_path.name} not found beside it")
        extra = labels_path.read_text().split()
    items, problems = [], {}
    for index, record in enumerate(records):
        try:
            missing = needed - set(record)
            if missing:
                raise ItemProblem(f"missing_{sorted(missing)[0]}")
            items.append(parse(index, record, extra))
        except ItemProblem as problem:
            problems[str(problem)] = problems.get(str(problem), 0) + 1
    if not items:
        raise EvalDataError(f"{path}: none of {len(records)} records can be scored as {fmt} "
                            f"({', '.join(f'{k}: {v}' for k, v in sorted(problems.items()))})")
    return TaskData(name=task_name(path), path=str(path), format=fmt, kind=kind, items=items,
                    problems=problems, records=len(records))
