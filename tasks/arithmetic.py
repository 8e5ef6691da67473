"""Generated, verifiable arithmetic tasks: the demo's SFT, preference and evaluation data.

Problems are small additions and subtractions. Each problem belongs to exactly one split, chosen
by a hash of its text, so training data (SFT, DPO) never contains an evaluation problem.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from tasks.chat import Message

Split = Literal["train", "test"]
TEST_PERCENT = 20  # share of all possible problems reserved for evaluation

_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def split_of(question: str) -> Split:
    bucket = int(hashlib.sha256(question.encode()).hexdigest(), 16) % 100
    return "test" if bucket < TEST_PERCENT else "train"


def problems(split: Split, n: int, seed: int, max_operand: int = 20) -> list[Problem]:
    """`n` distinct problems from `split`, deterministic in (split, n, seed, max_operand)."""
    universe = [
        Problem(f"What is {a} {op} {b}?", a + b if op == "+" else a - b)
        for a in range(max_operand + 1) for b in range(max_operand + 1) for op in "+-"
    ]
    pool = [p for p in universe if split_of(p.question) == split]
    if n > len(pool):
        raise ValueError(f"asked for {n} {split} problems but only {len(pool)} exist "
                         f"with max_operand={max_operand}")
    return random.Random(seed).sample(pool, n)


def answer_text(answer: int) -> str:
    return f"The answer is {answer}."


def conversation(p: Problem) -> list[Message]:
    """The SFT example: the question and the correct answer in the canonical format."""
    return [{"role": "user", "content": p.question},
            {"role": "assistant", "content": answer_text(p.answer)}]


def preference_pair(p: Problem, rng: random.Random) -> dict:
    """A DPO pair: the correct answer is chosen, a near-miss wrong answer is rejected."""
    wrong = p.answer + rng.choice([-2, -1, 1, 2])
    return {"prompt": [{"role": "user", "content": p.question}],
            "chosen": answer_text(p.answer), "rejected": answer_text(wrong)}


def extract_answer(text: str) -> int | None:
    """The first integer in a completion, or None when it has none."""
    match = _NUMBER.search(text)
    return int(match.group()) if match else None


def is_correct(completion: str, p: Problem) -> bool:
    return extract_answer(completion) == p.answer
