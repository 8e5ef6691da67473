"""gristmill's benchmark engine against lm-evaluation-harness 0.4.13, item by item.

Both score the same tiny model on the same real items through our shipped task YAMLs
(tasks/evaluate/lm_eval_tasks, loaded by a TaskManager include_path): every per-choice
log-likelihood, greedy flag and prediction must agree. lm-eval runs in-process, offline.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.evaluate.engine import EvalOptions, evaluate_task, load_model
from tasks.evaluate.formats import load_task

pytest.importorskip("lm_eval")

YAMLS = Path(__file__).resolve().parents[1] / "tasks" / "evaluate" / "lm_eval_tasks"
LIMIT = 20
# our file (under eval/) -> the lm-eval task of the same YAML
TASKS = {"hellaswag/hellaswag_val_part1.jsonl": "gristmill_hellaswag",
         "winogrande/winogrande_part1.jsonl": "gristmill_winogrande",
         "lambada_openai/lambada_openai_part1.jsonl": "gristmill_lambada_openai",
         "arc_easy/arc_easy_part1.jsonl": "gristmill_arc_easy",
         "piqa/valid_part1.jsonl": "gristmill_piqa",
         "mmlu_redux/mmlu_redux_part1.jsonl": "gristmill_mmlu_redux"}


@pytest.fixture(scope="module")
def both(shared_data, tiny_model_dir, one_torch_thread):
    """(our rows per lm-eval task, lm-eval's samples per task)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = load_model(tiny_model_dir, "cpu")
    ours = {}
    for path, task in TASKS.items():
        data = load_task(shared_data / "eval" / path, limit=LIMIT)
        ours[task] = evaluate_task(model, tokenizer, data, EvalOptions(batch_size=8), "cpu")[1]
    manager = TaskManager(include_path=str(YAMLS), include_defaults=False,
                          metadata={"eval_dir": str(shared_data / "eval")})
    theirs = lm_eval.simple_evaluate(model=HFLM(pretrained=str(tiny_model_dir), device="cpu", batch_size=1),
                                     tasks=list(TASKS.values()), task_manager=manager, limit=LIMIT,
                                     log_samples=True, bootstrap_iters=0)["samples"]
    return ours, {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in theirs.items()}


@pytest.mark.parametrize("task", [t for t in TASKS.values() if t != "gristmill_lambada_openai"])
def test_choice_logliks_and_predictions_equal_lm_eval(both, task):
    ours, theirs = both
    assert len(ours[task]) >= LIMIT - 5  # MMLU-Redux: flagged items are left out by both
    for row, sample in zip(ours[task], theirs[task]):  # flagged MMLU items drop out of both in order
        lls = [resp[0][0] for resp in sample["resps"]]
        assert row["loglik"] == pytest.approx(lls, rel=1e-5, abs=1e-4), (task, row["id"])
        assert float(row["correct"]) == sample["acc"], (task, row["id"])
        if "acc_norm" in sample:
            assert float(row["correct_norm"]) == sample["acc_norm"], (task, row["id"])


def test_lambada_logliks_and_greedy_match_equal_lm_eval(both):
    ours, theirs = both
    task = "gristmill_lambada_openai"
    assert len(ours[task]) == len(theirs[task]) == LIMIT
    for row, sample in zip(ours[task], theirs[task]):
        ll, greedy = sample["resps"][0][0]
        assert row["loglik"][0] == pytest.approx(ll, rel=1e-5, abs=1e-4)
        assert row["correct"] == greedy


def test_the_comparison_can_fail(both, tiny_model_dir):
    """Scoring the choice without its leading space (another prompt convention) gives numbers
    lm-eval does not: the equality above is not vacuous."""
    from tasks.evaluate.scoring import LoglikScorer

    sample = both[1]["gristmill_arc_easy"][0]
    (context, continuation), expected = sample["arguments"][0], sample["resps"][0][0][0]
    scorer = LoglikScorer(*load_model(tiny_model_dir, "cpu"), "cpu")
    assert scorer.loglikelihoods([(context, continuation)])[0][0] == pytest.approx(expected, abs=1e-4)
    assert scorer.loglikelihoods([(context, continuation.lstrip())])[0][0] != pytest.approx(expected, abs=1e-2)


def test_gsm8k_completions_and_matches_equal_lm_eval(shared_data, tiny_model_dir, one_torch_thread):
    """Generation too: the same 5-shot prompt, greedy completion (cut at "Question:") and
    final-number match as lm-eval's generate_until with our gristmill_gsm8k YAML."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = load_model(tiny_model_dir, "cpu")
    data = load_task(shared_data / "eval" / "gsm8k" / "test_part1.jsonl", limit=4)
    rows = evaluate_task(model, tokenizer, data, EvalOptions(max_new_tokens=12), "cpu")[1]
    manager = TaskManager(include_path=str(YAMLS), include_defaults=False,
                          metadata={"eval_dir": str(shared_data / "eval")})
    samples = lm_eval.simple_evaluate(model=HFLM(pretrained=str(tiny_model_dir), device="cpu", batch_size=4),
                                      tasks=["gristmill_gsm8k"], task_manager=manager, limit=4, log_samples=True,
                                      bootstrap_iters=0, gen_kwargs={"max_gen_toks": 12})["samples"]["gristmill_gsm8k"]
    samples = sorted(samples, key=lambda s: s["doc_id"])
    assert [r["completion"] for r in rows] == [s["resps"][0][0] for s in samples]
    assert [float(r["correct"]) for r in rows] == [s["exact_match"] for s in samples]
    assert samples[0]["arguments"][0][0].count("Question: ") == 6  # five worked examples, then the question
