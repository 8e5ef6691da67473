"""Generated, verifiable arithmetic tasks: the demo's SFT, preference, RL and evaluation data.

Problems are small additions and subtractions. Each problem belongs to exactly one split, chosen
by a hash of its text, so training data (SFT, DPO, GRPO) never contains an evaluation problem.

The demo's SFT demonstrations come from two kinds of demonstrator, as real SFT data does: for
`HEDGE_PERCENT` of the problems (by another hash) the reply hedges, "The answer is 35, give or
take 1.", instead of committing, "The answer is 35.". A hedged reply does not verify (its final
number is not the answer), so the SFT model inherits a habit that alignment can remove and that
generalises across problems: DPO prefers committed answers, GRPO's verifiable reward pays for
them. The arithmetic itself a model this small learns only slowly (thousands of SFT steps), far
beyond what a few dozen alignment steps can teach; both styles put the number in the same
place, so the number a model has learned survives the change of habit.

Answers are checked by their final number (`final_number`): the last number in the text (after
the last "####" when there is one), with thousands commas, signs and decimals.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal

from gristmill.core.chat import Message

Split = Literal["train", "test"]
TEST_PERCENT = 20  # share of all possible problems reserved for evaluation
HEDGE_PERCENT = 70  # share of the SFT demonstrations that hedge instead of committing
MAX_OPERAND = 20  # operands of the demo problems are 0..MAX_OPERAND

# A number: digits with optional thousands separators, optional decimals, and a minus sign that
# is not a binary minus ("5-3" holds 5 and 3, not -3).
NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
GSM8K_MARK = "####"


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def _bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 100


def split_of(question: str) -> Split:
    return "test" if _bucket(question) < TEST_PERCENT else "train"


def universe(max_operand: int = MAX_OPERAND) -> list[Problem]:
    """Every problem `a + b` and `a - b` with operands 0..max_operand, in a fixed order."""
    return [Problem(f"What is {a} {op} {b}?", a + b if op == "+" else a - b)
            for a in range(max_operand + 1) for b in range(max_operand + 1) for op in "+-"]


def problems(split: Split, n: int, seed: int, max_operand: int = MAX_OPERAND) -> list[Problem]:
    """`n` distinct problems from `split`, deterministic in (split, n, seed, max_operand)."""
    pool = [p for p in universe(max_operand) if split_of(p.question) == split]
    if n > len(pool):
        raise ValueError(f"asked for {n} {split} problems but only {len(pool)} exist "
                         f"with max_operand={max_operand}")
    return random.Random(seed).sample(pool, n)


def answer_text(answer: int) -> str:
    """The committed, verifiable reply."""
    return f"The answer is {answer}."


def hedged_text(answer: int) -> str:
    """A hedging reply: its final number is the hedge, not the answer."""
    return f"The answer is {answer}, give or take 1."


def is_hedged(question: str) -> bool:
    """Whether the demo demonstration of this problem hedges (a hash independent of the split's)."""
    return _bucket("hedge:" + question) < HEDGE_PERCENT


def conversation(p: Problem) -> list[Message]:
    """The SFT example: the question and its demonstrator's reply (committed or hedged)."""
    reply = hedged_text(p.answer) if is_hedged(p.question) else answer_text(p.answer)
    return [{"role": "user", "content": p.question}, {"role": "assistant", "content": reply}]


def preference_pair(p: Problem, rng: random.Random) -> dict:
    """A DPO pair: the committed correct answer is chosen; rejected is, by a coin flip, a
    near-miss wrong answer or the hedged correct one."""
    wrong = p.answer + rng.choice([-2, -1, 1, 2])
    rejected = answer_text(wrong) if rng.random() < 0.5 else hedged_text(p.answer)
    return {"prompt": [{"role": "user", "content": p.question}],
            "chosen": answer_text(p.answer), "rejected": rejected}


def parse_number(text: str) -> Decimal | None:
    """A number written with optional commas and decimals, or None when `text` is not one."""
    try:
        return Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        return None


def final_number(text: str) -> Decimal | None:
    """The answer a completion gives: its last number (after the last "####" when it has one,
    GSM8K's answer marker); None when it has none."""
    if GSM8K_MARK in text:
        text = text.rsplit(GSM8K_MARK, 1)[1]
    numbers = NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def is_correct(completion: str, p: Problem) -> bool:
    """Whether the completion's final number is the answer (a hedge or a wrong number is not)."""
    return final_number(completion) == p.answer
