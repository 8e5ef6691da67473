"""The evaluate stage on a random tiny model, plus its arithmetic (bits per byte, MC scoring)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

import tasks.evaluate.stage as evaluate
from core.stage import Manifest, SerialEngine
from core.units import bits_per_byte

# --- pure arithmetic ----------------------------------------------------------------------------

def test_bits_per_byte_hand_computed():
    # 1000 val tokens from 4000 bytes; 500 evaluated tokens cover 2000 bytes. A loss of
    # ln(2) nats per token is 1 bit per token = 0.25 bits per byte at 4 bytes per token.
    n_bytes = evaluate.covered_bytes(val_bytes=4000, val_tokens=1000, tokens_evaluated=500)
    assert n_bytes == 2000
    assert bits_per_byte(math.log(2), n_bytes / 500) == pytest.approx(0.25)
    assert bits_per_byte(3.0, 1.0) == pytest.approx(3.0 / math.log(2))
    with pytest.raises(ValueError, match="bytes_per_token"):
        bits_per_byte(1.0, 0.0)


def test_eval_windows():
    assert evaluate.eval_windows(1001, seq_len=100, max_eval_tokens=10_000) == (100, 10)
    assert evaluate.eval_windows(1000, seq_len=100, max_eval_tokens=10_000) == (100, 9)  # needs a +1 target
    assert evaluate.eval_windows(1001, seq_len=100, max_eval_tokens=350) == (100, 3)
    assert evaluate.eval_windows(50, seq_len=100, max_eval_tokens=10_000) == (49, 1)  # short split
    with pytest.raises(ValueError):
        evaluate.eval_windows(1, seq_len=100, max_eval_tokens=10)


def test_mc_scorer_picks_highest_loglik():
    items = [{"query": "Q1", "choices": ["a", "bb", "c"], "gold": 1},
             {"query": "Q2", "choices": ["x", "y"], "gold": 0},
             {"query": "Q3", "choices": ["p", "q", "r", "s"], "gold": 3}]
    table = {"a": -5.0, "bb": -1.0, "c": -3.0, "x": -2.0, "y": -0.5, "p": -9.0, "q": -8.0, "r": -7.0, "s": -1.0}
    seen_contexts = []

    def stub(context, choices):
        seen_contexts.append(context)
        return [table[c] for c in choices]

    scores = evaluate.score_mc(items, stub, delimiter="\nAnswer: ")
    assert scores["acc"] == pytest.approx(2 / 3)  # Q2's gold "x" loses to "y"
    assert scores["n"] == 3
    assert scores["chance"] == pytest.approx((1 / 3 + 1 / 2 + 1 / 4) / 3)
    assert seen_contexts == ["Q1\nAnswer: ", "Q2\nAnswer: ", "Q3\nAnswer: "]


def test_split_context_moves_trailing_space():
    assert evaluate.split_context("Q?\nAnswer: ", "Paris") == ("Q?\nAnswer:", " Paris")
    assert evaluate.split_context("Q?", " Paris") == ("Q?", " Paris")


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValidationError, match="seq_len"):
        evaluate.Config(seq_len=0)
    with pytest.raises(ValidationError, match="mc_tasks"):
        evaluate.Config(mc_tasks=[str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValidationError):
        evaluate.Config(device="tpu")


def test_fingerprint_follows_file_contents(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n')
    before = evaluate.fingerprint(evaluate.Config(mc_tasks=[str(path)]))
    path.write_text('{"query": "q", "choices": ["a", "b"], "gold": 1}\n')
    assert evaluate.fingerprint(evaluate.Config(mc_tasks=[str(path)])) != before


# --- the stage on a random tiny model -----------------------------------------------------------

def _fake_tokenize(root: Path, tokenizer_dir: Path, shared_data: Path) -> Manifest:
    """A tokenize-like output: val.bin from real text with the fixture tokenizer, and its meta."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = (shared_data / "corpus" / "botchan_en.txt").read_text(encoding="utf-8")
    docs = [text[i: i + 1000] for i in range(0, 12_000, 1000)]
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = [t for d in docs for t in tok.encode(d, add_special_tokens=False) + [sep]]
    (root / "tokens").mkdir(parents=True)
    np.asarray(ids, dtype=np.uint16).tofile(root / "tokens" / "val.bin")
    meta = {"dtype": "uint16", "vocab_size": len(tok), "train_tokens": 0, "val_tokens": len(ids),
            "train_docs": 0, "val_docs": len(docs), "val_bytes": sum(len(d.encode()) for d in docs)}
    (root / "tokens" / "meta.json").write_text(json.dumps(meta))
    return Manifest(stage="tokenize", key="tokenize-test", path=root, config={}, upstream={},
                    files={}, stats={})


def _model_manifest(stage: str, model_dir: Path, root: Path) -> Manifest:
    # Each training stage's artifact dir holds `model/`; the fixture dir is that model.
    (root / stage).mkdir(parents=True)
    (root / stage / "model").symlink_to(model_dir, target_is_directory=True)
    return Manifest(stage=stage, key=f"{stage}-test", path=root / stage, config={}, upstream={},
                    files={}, stats={})


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory, tiny_model_dir, shared_data):
    root = tmp_path_factory.mktemp("evaluate")
    inputs = {"tokenize": _fake_tokenize(root / "tokenize", tiny_model_dir, shared_data)}
    for stage in ("pretrain", "sft", "align"):
        inputs[stage] = _model_manifest(stage, tiny_model_dir, root)
    mc_path = shared_data / "eval" / "arc_easy" / "arc_easy_part1.jsonl"
    config = evaluate.Config(seq_len=64, max_eval_tokens=640, arith_problems=12, max_new_tokens=6,
                             batch_size=8, mc_tasks=[str(mc_path)], mc_max_items=20, device="cpu")
    out = root / "out"
    result = evaluate.run(config, inputs, out, engine=SerialEngine())
    return result, out, inputs


def test_random_model_perplexity_near_vocab(stage_run, tiny_model_dir):
    result, out, _ = stage_run
    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    results = json.loads((out / "results.json").read_text())["models"]
    assert set(results) == {"base", "sft", "aligned"}
    for label in results:
        ppl = result.stats[f"{label}_val_ppl"]
        assert vocab / 3 < ppl < vocab * 3, (label, ppl, vocab)
        assert result.stats[f"{label}_val_bpb"] > 0
        assert result.stats[f"{label}_val_tokens_evaluated"] == 640
        assert ppl == pytest.approx(math.exp(result.stats[f"{label}_val_loss"]))
    # The same model under three labels gives the same numbers.
    assert result.stats["base_val_bpb"] == pytest.approx(result.stats["aligned_val_bpb"])


def test_bpb_consistent_with_loss_and_meta(stage_run):
    result, _, inputs = stage_run
    meta = json.loads((inputs["tokenize"].path / "tokens" / "meta.json").read_text())
    n_bytes = meta["val_bytes"] * 640 / meta["val_tokens"]
    expected = result.stats["sft_val_loss"] * 640 / (math.log(2) * n_bytes)
    assert result.stats["sft_val_bpb"] == pytest.approx(expected)


def test_task_scores_are_fractions_with_item_counts(stage_run):
    result, out, _ = stage_run
    for label in ("base", "sft", "aligned"):
        assert result.stats[f"{label}_arith_n"] == 12
        acc = result.stats[f"{label}_arith_acc"]
        assert 0.0 <= acc <= 1.0 and (acc * 12) == pytest.approx(round(acc * 12))
        assert result.stats[f"{label}_mc_arc_easy_part1_n"] == 20
        assert 0.0 <= result.stats[f"{label}_mc_arc_easy_part1_acc"] <= 1.0
        assert result.stats[f"{label}_mc_arc_easy_part1_chance"] == pytest.approx(0.25, abs=0.02)
    examples = json.loads((out / "results.json").read_text())["models"]["base"]["arith_examples"]
    assert examples and all("<|im_end|>" not in e["completion"] for e in examples)


def test_report_has_a_row_per_metric_and_three_model_columns(stage_run):
    result, out, inputs = stage_run
    report = (out / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| metric"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["metric", "base", "sft", "aligned", "items"]
    for metric in ("val perplexity", "val bits per byte", "arithmetic accuracy", "arc_easy_part1 accuracy"):
        rows = [line for line in report.splitlines() if line.startswith(f"| {metric}")]
        assert len(rows) == 1, metric
        assert len(rows[0].strip("|").split("|")) == 5
    assert f"{result.stats['base_val_ppl']:.2f}" in report
    for manifest in inputs.values():
        assert manifest.key in report
    assert result.artifacts == ["report.md", "results.json"]


def test_batched_generation_matches_one_at_a_time(tiny_model_dir):
    from core.arithmetic import problems
    from core.chat import prompt_ids

    model, tok = evaluate.load_model(tiny_model_dir, "cpu")
    prompts = [prompt_ids(tok, [{"role": "user", "content": p.question}])
               for p in problems("test", 4, seed=1)]
    prompts.append(prompt_ids(tok, [{"role": "user", "content": "What is 12 + 7? Explain."}]))
    batched = evaluate.generate_greedy(model, tok, prompts, max_new_tokens=5, device="cpu")
    single = [evaluate.generate_greedy(model, tok, [p], max_new_tokens=5, device="cpu")[0] for p in prompts]
    assert batched == single


def test_arithmetic_accuracy_counts_correct_answers(monkeypatch, tiny_model_dir):
    """With generation stubbed to answer only even-valued problems correctly, accuracy is their share."""
    import core.arithmetic as arithmetic

    model, tok = evaluate.load_model(tiny_model_dir, "cpu")
    probs = arithmetic.problems("test", 10, seed=3)
    answers = {tuple(evaluate.prompt_ids(tok, [{"role": "user", "content": p.question}])): p.answer
               for p in probs}

    def fake_generate(model, tokenizer, prompts, max_new_tokens, device, batch_size=None):
        out = []
        for prompt in prompts:
            answer = answers[tuple(prompt)]
            out.append(arithmetic.answer_text(answer if answer % 2 == 0 else answer + 1))
        return out

    monkeypatch.setattr(evaluate, "generate_greedy", fake_generate)
    config = evaluate.Config(arith_problems=10, arith_seed=3, batch_size=4)
    scores = evaluate.arithmetic_accuracy(model, tok, config, "cpu")
    expected = sum(p.answer % 2 == 0 for p in probs) / 10
    assert scores["arith_n"] == 10 and scores["arith_acc"] == pytest.approx(expected)
    assert 0 < expected < 1
