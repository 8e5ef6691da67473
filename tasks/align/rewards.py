"""Verifiable rewards for reinforcement learning on math problems, and the prompts they score.

A reward function takes a batch of completions (plain strings, or TRL's conversational form: a
list holding one assistant message) plus dataset columns as keyword lists, and returns one float
per completion, so it plugs into TRL's `GRPOTrainer(reward_funcs=...)` as it is:

- `numeric_match_reward`: 1.0 when the completion's final number (`gristmill.core.arithmetic.final_number`)
  equals the reference `answer` exactly (as numbers: "1,000" == "1000", "42.0" == "42"), else 0.0;
- `format_reward`: 1.0 when the completion ends with the answer sentence the prompts ask for,
  "The answer is <number>." (core.arithmetic.answer_text), else 0.0.

Prompt sources (`load_math_prompts`): `demo:arithmetic` (generated problems, core.arithmetic) or
a JSONL(.gz) file of word problems with a numeric answer: SVAMP (`context`, `answer`), GSM8K
(`question`, `answer` ending in "#### <n>") or plain `question`/`prompt` + `answer`. Records
without a parsable reference answer are dropped and counted.
"""
from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gristmill.core.arithmetic as arithmetic
from gristmill.core.files import iter_jsonl
from gristmill.core.sources import read_source

# Asked of word problems so the completion ends in the demo's answer sentence, which
# `format_reward` checks and the demo SFT data teaches.
ANSWER_INSTRUCTION = "End your reply with: The answer is <number>."

_FORMAT = re.compile(r"(?:^|[\s\S]*\s)The answer is " + arithmetic.NUMBER.pattern + r"\.\s*$")

MathPrompt = dict[str, Any]  # {"prompt": list[Message], "answer": str}


def completion_text(completion: Any) -> str:
    """A completion as text: TRL passes strings, or a list of messages for chat prompts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    raise TypeError(f"unexpected completion type {type(completion).__name__}")


def is_numeric_match(completion: Any, answer: str) -> bool:
    reference = arithmetic.parse_number(str(answer))
    given = arithmetic.final_number(completion_text(completion))
    return reference is not None and given is not None and given == reference


def numeric_match_reward(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
    """1.0 where a completion's final number equals its reference answer exactly, else 0.0."""
    return [float(is_numeric_match(c, a)) for c, a in zip(completions, answer, strict=True)]


def format_reward(completions: Sequence[Any], **_: Any) -> list[float]:
    """1.0 where a completion ends with "The answer is <number>.", else 0.0."""
    return [float(bool(_FORMAT.fullmatch(completion_text(c)))) for c in completions]


# ---------------------------------------------------------------- prompts

def reference_answer(record: dict[str, Any]) -> str | None:
    """The record's numeric answer as a canonical string; GSM8K answers end in "#### <n>"."""
    raw = record.get("answer")
    if raw is None:
        return None
    raw = str(raw)
    if arithmetic.GSM8K_MARK in raw:
        raw = raw.rsplit(arithmetic.GSM8K_MARK, 1)[1]
    number = arithmetic.parse_number(raw)
    if number is None or not number.is_finite():
        return None
    return format(number.normalize(), "f")


def parse_math_record(record: Any) -> MathPrompt | str:
    """A prompt with its reference answer, or the snake_case reason the record is unusable."""
    if not isinstance(record, dict):
        return "unparseable_record"
    question = next((record[k] for k in ("context", "question", "prompt") if k in record), None)
    if not isinstance(question, str) or not question.strip():
        return "no_question"
    answer = reference_answer(record)
    if answer is None:
        return "no_numeric_answer"
    return {"prompt": [{"role": "user", "content": f"{question.strip()}\n{ANSWER_INSTRUCTION}"}],
            "answer": answer}


def demo_prompts(limit: int | None, seed: int) -> list[MathPrompt]:
    """Generated arithmetic problems of both splits in a seeded order, asked as the demo SFT data
    asks them (split them with `gristmill.core.arithmetic.split_of`)."""
    probs = arithmetic.universe()
    random.Random(seed).shuffle(probs)
    return [{"prompt": [{"role": "user", "content": p.question}], "answer": str(p.answer)}
            for p in probs[:limit]]


def _file_prompts(path: Path | str) -> Iterator[MathPrompt | str]:
    return (parse_math_record(record) for record in iter_jsonl([path]))


def load_math_prompts(source: str, limit: int | None, *,
                      seed: int = 0) -> tuple[list[MathPrompt], dict[str, int]]:
    """Up to `limit` prompts with reference answers from `source` (file order; demo problems in
    an order drawn with `seed`) and dropped-record counts per reason. Nothing usable is a
    ValueError naming the source."""
    return read_source(source, "prompt source", {"arithmetic": lambda n: demo_prompts(n, seed)}, _file_prompts, limit,
                       "prompts")
