"""Verifiable rewards (final-number extraction, exact match, format) and math-prompt loading."""
from __future__ import annotations

import gzip
import json
from decimal import Decimal

import pytest

import gristmill.core.arithmetic as arithmetic
from gristmill.core.arithmetic import final_number
from gristmill.tasks.align.rewards import (
    ANSWER_INSTRUCTION,
    format_reward,
    load_math_prompts,
    numeric_match_reward,
    parse_math_record,
    reference_answer,
)


@pytest.mark.parametrize("text, number", [
    ("#### 42", "42"),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("The answer is 42.", "42"),
    ("The answer is -7.", "-7"),
    ("So 3 + 4 = 7. The answer is: $1,250.50 in total", "1250.50"),
    ("42", "42"),
    ("  -0.5 ", "-0.5"),
    ("I think 12, no wait, 1,000", "1000"),
    ("5-3 leaves 2", "2"),            # "-3" in "5-3" is a binary minus, and the last number wins
    ("The answer is 8. Check: 8 - 5 = 3", "3"),  # the final number, whatever precedes it
    ("The answer is 35, give or take 1.", "1"),  # a hedge is not an answer
    ("12 apples #### 3,456", "3456"),  # GSM8K marker beats everything before it
    ("It is 7.", "7"),                 # a sentence's full stop is not a decimal point
])
def test_final_number(text, number):
    assert final_number(text) == Decimal(number)


@pytest.mark.parametrize("text", ["", "no digits here", "####", "minus - sign"])
def test_final_number_none(text):
    assert final_number(text) is None


def test_numeric_match_is_exact_and_numeric():
    completions = ["The answer is 42.", "The answer is 42.0.", "#### 1,000", "The answer is 41.",
                   "no idea", "The answer is -3.", "The answer is 3."]
    answers = ["42", "42", "1000", "42", "42", "-3", "-3"]
    assert numeric_match_reward(completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_rewards_take_trl_conversational_completions_and_extra_columns():
    completions = [[{"role": "assistant", "content": "The answer is 5."}],
                   [{"role": "assistant", "content": "5"}]]
    kwargs = {"prompts": [[], []], "completion_ids": [[1], [2]], "trainer_state": None}
    assert numeric_match_reward(completions, answer=["5", "6"], **kwargs) == [1.0, 0.0]
    assert format_reward(completions, answer=["5", "6"], **kwargs) == [1.0, 0.0]


@pytest.mark.parametrize("text, ok", [
    ("The answer is 7.", True),
    ("The answer is -12.", True),
    ("3 + 4 = 7. The answer is 7.", True),
    ("The answer is 1,234.5.  ", True),
    ("The answer is 7", False),          # no full stop
    ("the answer is 7.", False),         # the sentence as asked, capitalised
    ("The answer is seven.", False),
    ("The answer is 7. Or 8.", False),   # must end with the answer sentence
    ("#### 7", False),
    ("", False),
])
def test_format_reward(text, ok):
    assert format_reward([text]) == [float(ok)]


def test_demo_arithmetic_completion_is_both_correct_and_formatted():
    p = arithmetic.problems("train", 1, seed=0)[0]
    text = arithmetic.answer_text(p.answer)
    assert numeric_match_reward([text], [str(p.answer)]) == [1.0] and format_reward([text]) == [1.0]


# ---------------------------------------------------------------- prompts

def test_reference_answers():
    assert reference_answer({"answer": "17"}) == "17"
    assert reference_answer({"answer": "He has 5 left.\n#### 1,200"}) == "1200"
    assert reference_answer({"answer": 3.50}) == "3.5"
    assert reference_answer({"answer": "12.0"}) == "12"
    assert reference_answer({"answer": "about five"}) is None
    assert reference_answer({"answer": "nan"}) is None
    assert reference_answer({}) is None


def test_svamp_records_become_prompts_with_the_answer_instruction(shared_data):
    path = shared_data / "rl" / "svamp.jsonl"
    prompts, drops = load_math_prompts(str(path), None)
    assert len(prompts) == 300 and drops == {}  # every SVAMP record has a numeric answer
    first = json.loads(path.read_text().splitlines()[0])
    assert prompts[0] == {"prompt": [{"role": "user", "content": f"{first['context']}\n{ANSWER_INSTRUCTION}"}],
                          "answer": first["answer"]}
    assert len(load_math_prompts(str(path), 7)[0]) == 7


def test_bad_records_are_dropped_and_counted(tmp_path):
    rows = [{"question": "What is 2 + 2?", "answer": "#### 4"},
            {"question": "How many?", "answer": "several"},
            {"question": "  ", "answer": "1"},
            {"text": "no question field", "answer": "1"},
            ["not", "a", "record"],
            {"prompt": "Half of 9?", "answer": 4.5}]
    path = tmp_path / "math.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    prompts, drops = load_math_prompts(str(path), None)
    assert [p["answer"] for p in prompts] == ["4", "4.5"]
    assert drops == {"no_numeric_answer": 1, "no_question": 2, "unparseable_record": 1}
    assert parse_math_record({"context": "c", "answer": "x"}) == "no_numeric_answer"


def test_empty_source_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "useless.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "none"}) + "\n")
    with pytest.raises(ValueError, match=r"useless\.jsonl.*no usable prompts.*no_numeric_answer"):
        load_math_prompts(str(path), None)
    with pytest.raises(ValueError, match=r"missing\.jsonl"):
        load_math_prompts(str(tmp_path / "missing.jsonl"), None)
    with pytest.raises(ValueError, match="demo:nope"):
        load_math_prompts("demo:nope", None)


def test_demo_prompts_cover_both_splits_in_a_seeded_order():
    a, drops = load_math_prompts("demo:arithmetic", None, seed=1)
    b, _ = load_math_prompts("demo:arithmetic", None, seed=1)
    c, _ = load_math_prompts("demo:arithmetic", None, seed=2)
    assert a == b and a != c and drops == {}
    assert len(a) == len(arithmetic.universe())
    splits = {arithmetic.split_of(p["prompt"][0]["content"]) for p in a}
    assert splits == {"train", "test"}
    assert all(numeric_match_reward([f"The answer is {p['answer']}."], [p["answer"]]) == [1.0] for p in a)
    assert len(load_math_prompts("demo:arithmetic", 5, seed=1)[0]) == 5


def test_hedged_demonstrations_do_not_verify_and_committed_ones_do():
    probs = arithmetic.problems("train", 200, seed=0)
    replies = {p: arithmetic.conversation(p)[1]["content"] for p in probs}
    hedged = [p for p in probs if arithmetic.is_hedged(p.question)]
    share = arithmetic.HEDGE_PERCENT / 100
    assert share - 0.1 < len(hedged) / len(probs) < share + 0.1  # by hash
    for p, reply in replies.items():
        verified = arithmetic.is_correct(reply, p) and format_reward([reply]) == [1.0]
        assert verified != arithmetic.is_hedged(p.question), reply
    assert arithmetic.hedged_text(35) == "The answer is 35, give or take 1."
    assert arithmetic.final_number(arithmetic.hedged_text(35)) == 1


def test_demo_preference_pairs_prefer_committed_correct_answers():
    import random

    rng = random.Random(0)
    pairs = [(p, arithmetic.preference_pair(p, rng)) for p in arithmetic.problems("train", 100, seed=0)]
    assert all(pair["chosen"] == arithmetic.answer_text(p.answer) for p, pair in pairs)
    near_miss = [pair for p, pair in pairs if pair["rejected"].endswith(".") and "give" not in pair["rejected"]]
    hedges = [pair for p, pair in pairs if pair["rejected"] == arithmetic.hedged_text(p.answer)]
    assert len(near_miss) + len(hedges) == 100 and 30 < len(hedges) < 70
    assert all(not arithmetic.is_correct(pair["rejected"], p) for p, pair in pairs)
