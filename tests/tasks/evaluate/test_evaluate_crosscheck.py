"""gristmill's benchmark engine against lm-evaluation-harness 0.4.13, item by item.

Both score the same tiny model on the same real items, first through our shipped task YAMLs
(tasks/evaluate/lm_eval_tasks, loaded by a TaskManager include_path), then through lm-eval's own
standard tasks (copa, boolq, piqa, winogrande, lambada_openai, arc_easy, mmlu_<subject> with its
subject line), the shared files converted to the schemas those read (lm_eval_tasks/standard.py):
every per-choice log-likelihood, greedy flag and prediction must agree. lm-eval runs in-process,
offline.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from gristmill.tasks.evaluate.engine import EvalOptions, evaluate_task, load_model
from gristmill.tasks.evaluate.formats import load_task, piqa_labels_path, read_records
from gristmill.tasks.evaluate.lm_eval_tasks.standard import convert, write_task

pytest.importorskip("lm_eval")

YAMLS = Path(__file__).resolve().parents[3] / "tasks" / "evaluate" / "lm_eval_tasks"
LIMIT = 20
# our file (under eval/) -> the lm-eval task of the same YAML
TASKS = {"hellaswag/hellaswag_val_part1.jsonl": "gristmill_hellaswag",
         "winogrande/winogrande_part1.jsonl": "gristmill_winogrande",
         "lambada_openai/lambada_openai_part1.jsonl": "gristmill_lambada_openai",
         "arc_easy/arc_easy_part1.jsonl": "gristmill_arc_easy",
         "piqa/valid_part1.jsonl": "gristmill_piqa",
         "mmlu_redux/mmlu_redux_part1.jsonl": "gristmill_mmlu_redux"}
STANDARD_LIMIT = 8
# lm-eval's own task -> our file; the MMLU-Redux file opens with its abstract_algebra rows
STANDARD = {"copa": "copa/copa_part1.jsonl", "boolq": "boolq/boolq_part1.jsonl",
            "piqa": "piqa/valid_part1.jsonl", "winogrande": "winogrande/winogrande_part1.jsonl",
            "lambada_openai": "lambada_openai/lambada_openai_part1.jsonl",
            "arc_easy": "arc_easy/arc_easy_part1.jsonl",
            "mmlu_abstract_algebra": "mmlu_redux/mmlu_redux_part1.jsonl"}


def _ours(model_dir: Path, paths: dict[str, Path], limit: int, **load: str) -> dict[str, list[dict]]:
    model, tokenizer = load_model(model_dir, "cpu")
    return {task: evaluate_task(model, tokenizer, load_task(path, limit=limit, **load),
                                EvalOptions(batch_size=8), "cpu")[1] for task, path in paths.items()}


def _lm_eval(model_dir: Path, manager, tasks: list[str], limit: int | None) -> dict[str, list[dict]]:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    samples = lm_eval.simple_evaluate(model=HFLM(pretrained=str(model_dir), device="cpu", batch_size=1),
                                      tasks=tasks, task_manager=manager, limit=limit, log_samples=True,
                                      bootstrap_iters=0)["samples"]
    return {task: sorted(s, key=lambda s: s["doc_id"]) for task, s in samples.items()}


def _assert_equal(task: str, rows: list[dict], samples: list[dict]) -> None:
    """Per item: every log-likelihood (to 1e-4), acc (LAMBADA: the greedy flag) and acc_norm."""
    for row, sample in zip(rows, samples, strict=False):
        lls = [resp[0][0] for resp in sample["resps"]]
        assert row["loglik"] == pytest.approx(lls, rel=1e-5, abs=1e-4), (task, row["id"])
        assert float(row["correct"]) == sample["acc"], (task, row["id"])
        if "acc_norm" in sample:
            assert float(row["correct_norm"]) == sample["acc_norm"], (task, row["id"])


@pytest.fixture(scope="module")
def both(shared_data, tiny_model_dir, one_torch_thread):
    """(our rows per lm-eval task, lm-eval's samples per task), through our YAMLs."""
    from lm_eval.tasks import TaskManager

    ours = _ours(tiny_model_dir, {task: shared_data / "eval" / path for path, task in TASKS.items()}, LIMIT)
    manager = TaskManager(include_path=str(YAMLS), include_defaults=False,
                          metadata={"eval_dir": str(shared_data / "eval")})
    return ours, _lm_eval(tiny_model_dir, manager, list(TASKS.values()), LIMIT)


@pytest.mark.parametrize("task", TASKS.values())
def test_logliks_and_predictions_equal_our_lm_eval_yamls(both, task):
    ours, theirs = both
    # MMLU-Redux: flagged items drop out of both, in order; lm-eval's first LIMIT are all unflagged
    assert LIMIT - 5 <= len(ours[task]) <= len(theirs[task]) == LIMIT
    _assert_equal(task, ours[task], theirs[task])


@pytest.fixture(scope="module")
def standard(shared_data, tiny_model_dir, one_torch_thread, tmp_path_factory):
    """(our rows, lm-eval's samples) per lm-eval standard task on the first STANDARD_LIMIT records
    of our file, the records we score converted to the task's schema."""
    from lm_eval.tasks import TaskManager

    paths = {task: shared_data / "eval" / path for task, path in STANDARD.items()}
    ours = _ours(tiny_model_dir, paths, STANDARD_LIMIT)
    out = tmp_path_factory.mktemp("lm_eval_standard")
    for task, path in paths.items():
        records = read_records(path, STANDARD_LIMIT)
        if task == "piqa":  # its labels are a file beside the questions
            records = [{**r, "label": label} for r, label in zip(records, piqa_labels_path(path).read_text().split())]
        ids = [row["id"] for row in ours[task]]  # MMLU-Redux: flagged items are left out
        write_task(task, convert(task, [records[i] for i in ids]), out)
    manager = TaskManager(include_path=str(out), include_defaults=False)
    return ours, _lm_eval(tiny_model_dir, manager, list(STANDARD), None)


@pytest.mark.parametrize("task", STANDARD)
def test_logliks_and_predictions_equal_lm_evals_own_tasks(standard, task):
    ours, theirs = standard
    assert len(ours[task]) == len(theirs[task]) >= STANDARD_LIMIT - 2
    _assert_equal(task, ours[task], theirs[task])


def test_mmlu_is_asked_with_lm_evals_subject_line(standard):
    context = standard[1]["mmlu_abstract_algebra"][0]["arguments"][0][0]
    assert context.startswith("The following are multiple choice questions (with answers) about abstract algebra.\n\n")


@pytest.mark.parametrize("delimiter", ["\nAnswer: ", " "])  # ours before; llm-foundry's own copa
def test_copa_with_another_delimiter_differs_from_lm_evals_copa(standard, shared_data, tiny_model_dir, delimiter):
    """COPA's delimiter decides the numbers: with gristmill's former "\nAnswer: " or llm-foundry's
    single space, no item's log-likelihoods equal lm-eval's copa (whose are ours by default)."""
    rows = _ours(tiny_model_dir, {"copa": shared_data / "eval" / STANDARD["copa"]}, STANDARD_LIMIT,
                 delimiter=delimiter)["copa"]
    for row, sample in zip(rows, standard[1]["copa"], strict=True):
        assert row["loglik"] != pytest.approx([resp[0][0] for resp in sample["resps"]], abs=1e-2)


def test_the_comparison_can_fail(both, tiny_model_dir):
    """Scoring the choice without its leading space (another prompt convention) gives numbers
    lm-eval does not: the equality above is not vacuous."""
    from gristmill.tasks.evaluate.scoring import LoglikScorer

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
