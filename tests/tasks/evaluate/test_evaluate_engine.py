"""The benchmark engine behind `gristmill evaluate`: formats, prompts, metrics, the command's
outputs, and bad input (each a clear error naming the file, or problems counted and shown)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from gristmill.flows.cli import main
from gristmill.tasks.evaluate import metrics
from gristmill.tasks.evaluate.config import Config
from gristmill.tasks.evaluate.engine import EvalOptions, _choice
from gristmill.tasks.evaluate.formats import EvalDataError, TaskData, foundry_task, load_task
from gristmill.tasks.evaluate.generation import fewshot_prompt, final_number


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- formats and prompts ------------------------------------------------------------------------

@pytest.mark.parametrize("path, fmt, first_request", [
    ("arc_easy/arc_easy_part1.jsonl", "mc",
     ("Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:",
      " Sunlight is the source of energy for nearly all ecosystems.")),
    ("hellaswag/hellaswag_val_part1.jsonl", "hellaswag",
     ("Roof shingle removal: A man is sitting on a roof. he", " is using wrap to wrap a pair of skis.")),
    ("winogrande/winogrande_part1.jsonl", "winogrande",
     ("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases.")),
    ("piqa/valid_part1.jsonl", "piqa",
     ("Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:",
      " Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, "
      "you will also need to supply it with a water bottle and a food dish.")),
])
def test_formats_are_recognised_and_prompted_as_lm_eval(shared_data, path, fmt, first_request):
    data = load_task(shared_data / "eval" / path, limit=3)
    assert data.format == fmt and len(data.items) == 3 and data.problems == {}
    assert data.items[0].requests[0] == first_request


@pytest.mark.parametrize("path, context_end, first_choice", [
    ("copa/copa_part1.jsonl", "The man turned on the faucet, therefore", "  the toilet filled with water."),
    ("boolq/boolq_part1.jsonl", "\nQuestion: does ethanol take more energy make that produces?\nAnswer:", " no"),
    ("arc_challenge/arc_challenge_part1.jsonl", "increase in rotation?\nAnswer:", " Planetary density will decrease."),
    ("openbookqa/openbookqa_part1.jsonl", "the best way to save money is to", " make more phone calls"),
])
def test_llm_foundry_files_take_their_benchmarks_delimiter(shared_data, path, context_end, first_choice):
    """ARC and BoolQ answer after "\nAnswer:", OpenBookQA continues the sentence, COPA's choices
    follow two spaces as in lm-eval's copa."""
    context, continuation = load_task(shared_data / "eval" / path, limit=1).items[0].requests[0]
    assert context.endswith(context_end) and continuation == first_choice


def test_a_delimiter_given_overrides_the_benchmarks(shared_data, tmp_path):
    copa = shared_data / "eval" / "copa" / "copa_part1.jsonl"
    assert load_task(copa, limit=1, delimiter="\nAnswer: ").items[0].requests[0] == \
        ("The man turned on the faucet, therefore\nAnswer:", " the toilet filled with water.")
    assert load_task(copa, limit=1, delimiter=" ").items[0].requests[0][1] == " the toilet filled with water."
    mine = _jsonl(tmp_path / "mine.jsonl", [{"query": "Q", "choices": ["a", "b"], "gold": 0}])
    assert load_task(mine).items[0].requests == (("Q", " a"), ("Q", " b"))  # llm-foundry's default
    assert foundry_task(tmp_path / "copa" / "test.jsonl") == "copa" and foundry_task(mine) is None
    with pytest.raises(EvalDataError, match="a delimiter was given but this is a hellaswag file"):
        load_task(shared_data / "eval" / "hellaswag" / "hellaswag_val_part1.jsonl", limit=1, delimiter=" ")
    with pytest.raises(ValidationError, match="delimiters: \\['copa'\\] name no file of tasks"):
        Config(tasks=(str(copa),), delimiters={"copa": " "})
    assert Config(tasks=(str(copa),), delimiters={"copa_part1": " "}).delimiters == {"copa_part1": " "}


def test_piqa_reads_its_labels_and_gsm8k_its_final_number(shared_data):
    piqa = load_task(shared_data / "eval" / "piqa" / "valid_part1.jsonl", limit=3)
    assert [i.gold for i in piqa.items] == [0, 1, 1]  # valid-labels_part1.lst
    gsm = load_task(shared_data / "eval" / "gsm8k" / "test_part1.jsonl", limit=2)
    assert gsm.format == "gsm8k" and gsm.name == "gsm8k_test_part1" and gsm.items[0].gold == "18"


def test_mmlu_prompt_and_flagged_items_are_counted(shared_data):
    data = load_task(shared_data / "eval" / "mmlu_redux" / "mmlu_redux_part1.jsonl", limit=20)
    context, continuation = data.items[0].requests[1]
    assert context.startswith("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
                              "Statement 1 | If T: V -> W")
    assert context.endswith("\nA. True, True\nB. False, False\nC. True, False\nD. False, True\nAnswer:")
    assert continuation == " B"

    class Stub:  # a scorer preferring choice A
        def score_groups(self, groups):
            return [[(-1.0 if cont == " A" else -2.0, False) for _, cont in group] for group in groups]

    summary, rows = _choice(Stub(), data, EvalOptions())
    assert sum(summary["flagged"].values()) + len(rows) == 20 and summary["flagged"]
    assert all(r["error_type"].lower() == "ok" for r in rows)
    assert summary["acc"] == pytest.approx(sum(r["gold"] == 0 for r in rows) / len(rows))
    assert len(_choice(Stub(), data, EvalOptions(include_flagged=True))[1]) == 20
    assert set(summary["subjects"]) == {r["subject"] for r in rows}


def test_choice_scoring_acc_norm_and_chance():
    """acc is the argmax of summed log-likelihoods; acc_norm divides by choice length in characters."""
    data = TaskData(name="t", path="t.jsonl", format="mc", kind="choice", items=[], problems={}, records=2)
    from gristmill.tasks.evaluate.formats import _mc

    data.items = [_mc(0, {"query": "Q", "choices": ["a", "bbbbbbbbbb"], "gold": 1}, " "),
                  _mc(1, {"query": "Q", "choices": ["x", "y", "z"], "gold": 0}, " ")]
    lls = {" a": -2.0, " bbbbbbbbbb": -5.0, " x": -1.0, " y": -3.0, " z": -4.0}

    class Stub:
        def score_groups(self, groups):
            return [[(lls[cont], False) for _, cont in group] for group in groups]

    summary, rows = _choice(Stub(), data, EvalOptions())
    assert [r["pred"] for r in rows] == [0, 0] and [r["pred_norm"] for r in rows] == [1, 0]
    assert summary["acc"] == 0.5 and summary["acc_norm"] == 1.0
    assert summary["chance"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert summary["centered_acc"] == pytest.approx((0.5 - summary["chance"]) / (1 - summary["chance"]))
    assert summary["acc_stderr"] == pytest.approx(0.5)  # sample std 0.7071 / sqrt(2)


# --- metrics ------------------------------------------------------------------------------------

def test_metrics_by_hand():
    assert metrics.mean_stderr([1, 0, 1, 1]) == pytest.approx(math.sqrt(0.25) / 2)
    assert metrics.mean_stderr([1]) is None
    assert metrics.centered(0.25, 0.25) == 0 and metrics.centered(1.0, 0.5) == 1
    assert metrics.pass_at_k(5, 0, 1) == 0 and metrics.pass_at_k(5, 5, 3) == 1
    assert metrics.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert metrics.pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert metrics.perplexity([-math.log(4), -math.log(4)]) == pytest.approx(4)
    assert metrics.core_score({"a": {"centered_acc": 0.2}, "b": {"centered_acc": 0.4}, "c": {"acc": 1.0}}) \
        == pytest.approx(0.3)


def test_gsm8k_answer_extraction_and_prompt():
    assert final_number("so she has 1,234 apples.") == "1234"
    assert final_number("It costs $18.\n\n") == "18"
    assert final_number("no idea") == "[invalid]"
    prompt = fewshot_prompt("How many?", 2)
    assert prompt.count("Question: ") == 3 and prompt.endswith("\n\nQuestion: How many?\nAnswer:")
    assert "#### 29\n\nQuestion:" in prompt


# --- the command --------------------------------------------------------------------------------

def test_evaluate_command_writes_results_and_items(shared_data, tiny_model_dir, tmp_path, capsys):
    eval_dir = shared_data / "eval"
    out = tmp_path / "res" / "results.json"
    code = main(["evaluate", str(tiny_model_dir), "--task", str(eval_dir / "copa" / "copa_part1.jsonl"),
                 "--task", str(eval_dir / "gsm8k" / "test_part1.jsonl"), "--limit", "4",
                 "--max-new-tokens", "8", "--samples", "2", "--shots", "1", "--device", "cpu", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "copa_part1" in printed and "core (mean centered accuracy)" in printed
    results = json.loads(out.read_text())
    copa = results["tasks"]["copa_part1"]
    assert copa["n"] == 4 and copa["chance"] == 0.5 and results["core"] == copa["centered_acc"]
    gsm = results["tasks"]["gsm8k_test_part1"]
    assert gsm["n"] == 4 and {"pass_at_1", "pass_at_2"} <= set(gsm) and 0 <= gsm["pass_at_1"] <= gsm["pass_at_2"] <= 1
    rows = [json.loads(line) for line in (out.parent / "results.items.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    copa_rows = [r for r in rows if r["task"] == "copa_part1"]
    assert [r["id"] for r in copa_rows] == [0, 1, 2, 3]
    assert all(len(r["loglik"]) == 2 and r["pred"] == max(range(2), key=r["loglik"].__getitem__) for r in copa_rows)
    assert copa["acc"] == sum(r["correct"] for r in copa_rows) / 4


# --- bad input ----------------------------------------------------------------------------------

def _evaluate(model_dir, task, tmp_path, *extra):
    out = tmp_path / "out.json"
    code = main(["evaluate", str(model_dir), "--task", str(task), "--device", "cpu", "--out", str(out), *extra])
    return code, out


def test_an_empty_file_is_an_error_naming_it(tiny_model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, out = _evaluate(tiny_model_dir, empty, tmp_path)
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err == f"gristmill: {empty}: no records (empty file)\n"


def test_an_unrecognised_file_names_its_fields(tiny_model_dir, tmp_path, capsys):
    odd = _jsonl(tmp_path / "odd.jsonl", [{"prompt": "x", "label": 1}])
    code, out = _evaluate(tiny_model_dir, odd, tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert str(odd) in err and "unrecognised" in err and "['label', 'prompt']" in err


def test_bad_items_are_counted_and_shown_and_an_all_bad_file_is_an_error(tiny_model_dir, tmp_path, capsys):
    mixed = _jsonl(tmp_path / "mixed.jsonl", [
        {"query": "Q1", "choices": ["a", "b"], "gold": 1},
        {"query": "Q2", "choices": ["a", "b"], "gold": 5},  # gold out of range
        {"query": "Q3", "gold": 0, "choices": None},  # choices missing
        {"query": "Q4", "choices": ["a", "b"]},  # gold missing
    ])
    data = load_task(mixed)
    assert len(data.items) == 1 and data.problems == {"gold_out_of_range": 1, "bad_choices": 1, "missing_gold": 1}
    code, out = _evaluate(tiny_model_dir, mixed, tmp_path)
    captured = capsys.readouterr()
    assert code == 0 and "left out 3 records" in captured.err and str(mixed) in captured.err
    assert json.loads(out.read_text())["tasks"]["mixed"]["problems"]["gold_out_of_range"] == 1
    assert "gold_out_of_range 1" in captured.out  # shown in the table

    bad = _jsonl(tmp_path / "bad.jsonl", [{"query": "Q", "choices": ["a"], "gold": 3}])
    with pytest.raises(EvalDataError, match=f"{bad}: none of 1 records"):
        load_task(bad)


def test_a_bad_line_is_named_by_file_and_line_and_only_the_lines_read_count(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"query": "Q", "choices": ["a", "b"], "gold": 0}\n\n[1]\n{"query"\n')
    with pytest.raises(EvalDataError, match=f"{path}:3: expected a JSON object, got list"):
        load_task(path)
    path.write_text('{"query": "Q", "choices": ["a", "b"], "gold": 0}\n{"query"\n')
    with pytest.raises(EvalDataError, match=f"{path}:2: not JSON"):
        load_task(path)
    assert len(load_task(path, limit=1).items) == 1  # the first N records: the bad line is never read


def test_an_unparsable_gsm8k_answer_is_a_counted_problem(tmp_path):
    path = _jsonl(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "1+1=2\n#### 2"},
                                           {"question": "?", "answer": "no final line"}])
    data = load_task(path)
    assert [i.gold for i in data.items] == ["2"] and data.problems == {"unparsable_answer": 1}


def test_the_delimiter_option_scores_that_task_with_it(tiny_model_dir, tmp_path, shared_data, capsys):
    from gristmill.tasks.evaluate.engine import load_model
    from gristmill.tasks.evaluate.scoring import LoglikScorer

    copa = shared_data / "eval" / "copa" / "copa_part1.jsonl"
    code, out = _evaluate(tiny_model_dir, copa, tmp_path, "--limit", "1", "--delimiter", "copa_part1=\\nAnswer: ")
    assert code == 0
    row = json.loads(out.with_name("out.items.jsonl").read_text())
    scorer = LoglikScorer(*load_model(tiny_model_dir, "cpu"), "cpu")
    pair = ("The man turned on the faucet, therefore\nAnswer:", " the toilet filled with water.")
    expected = scorer.loglikelihoods([pair])
    assert row["loglik"][0] == pytest.approx(expected[0][0], abs=1e-4)
    for bad, says in [("copa=\\nAnswer: ", "a delimiter is given for ['copa'] but no task file has that name"),
                      ("\\nAnswer: ", "expected TASK=TEXT")]:
        code, _ = _evaluate(tiny_model_dir, copa, tmp_path, "--delimiter", bad)
        assert code == 2 and says in capsys.readouterr().err


def test_a_model_dir_without_tokenizer_is_an_error_naming_it(tiny_model_dir, tmp_path, shared_data, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(tiny_model_dir / name)
    code, out = _evaluate(bare, shared_data / "eval" / "copa" / "copa_part1.jsonl", tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and f"{bare}: no tokenizer" in err


def test_a_damaged_weights_file_is_an_error_naming_it(tiny_model_dir, tmp_path, shared_data, capsys):
    """Cut short as by a full disk or an interrupted copy: transformers' own error names no file."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for path in tiny_model_dir.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, out = _evaluate(damaged, shared_data / "eval" / "copa" / "copa_part1.jsonl", tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and err.count("\n") == 1
    assert err.startswith(f"gristmill: {weights}: damaged weights file: ")


def test_a_limit_beyond_the_file_scores_all_and_says_so(tiny_model_dir, tmp_path, shared_data, capsys):
    copa = shared_data / "eval" / "copa" / "copa_part1.jsonl"
    small = _jsonl(tmp_path / "small.jsonl", [json.loads(line) for line in copa.read_text().splitlines()[:3]])
    code, out = _evaluate(tiny_model_dir, small, tmp_path, "--limit", "10")
    assert code == 0 and f"{small}: --limit 10 but the file has 3 records" in capsys.readouterr().err
    assert json.loads(out.read_text())["tasks"]["small"]["n"] == 3


def test_results_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """The JSON is renamed into place after the per-item file: a crash in between leaves no JSON."""
    from gristmill.tasks.evaluate import engine

    real = engine._atomic_write
    monkeypatch.setattr(engine, "_atomic_write", lambda path, text: (real(path, text) if path.suffix == ".jsonl"
                                                                     else (_ for _ in ()).throw(OSError("disk full"))))
    with pytest.raises(OSError):
        engine.write_results(tmp_path / "r.json", {"core": 0.1}, [{"id": 0}])
    assert not (tmp_path / "r.json").exists() and not list(tmp_path.glob(".*tmp*"))


def test_shared_prefix_packing_equals_scoring_each_request_alone(tiny_model_dir):
    """One row per item (common prefix once, a 4D mask) gives each request's own numbers."""
    from gristmill.tasks.evaluate.engine import load_model
    from gristmill.tasks.evaluate.scoring import LoglikScorer, _pack

    packed = _pack([([1, 2, 3, 4], [4]), ([1, 2, 5, 6, 7], [6, 7]), ([1, 2], [2])])
    assert packed.tokens == [1, 2, 3, 4, 5, 6, 7] and packed.positions == [0, 1, 2, 3, 2, 3, 4]
    assert packed.segments == [0, 0, 1, 1, 2, 2, 2]
    assert [w for w, _ in packed.targets] == [[3], [5, 6], [1]]  # rows whose logits predict each continuation

    scorer = LoglikScorer(*load_model(tiny_model_dir, "cpu"), "cpu", batch_size=2)
    group = [("The cat sat on the", " mat."), ("The cat sat on the", " mat and purred."),
             ("The cat sat on the ", "hat"), ("The dog", " barked")]
    together = scorer.score_groups([group, group[:1]])
    alone = [scorer.score_groups([[r]])[0][0] for r in group]
    assert [ll for ll, _ in together[0]] == pytest.approx([ll for ll, _ in alone], abs=1e-4)
    assert [g for _, g in together[0]] == [g for _, g in alone]
    assert together[1][0][0] == pytest.approx(alone[0][0], abs=1e-4)
