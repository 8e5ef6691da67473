"""The evaluate stage on a random tiny model, plus its arithmetic (bits per byte, windows); the
benchmark engine it runs has its own tests (test_evaluate_engine.py, test_evaluate_crosscheck.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

import gristmill.tasks.evaluate.stage as evaluate
from gristmill.core.stage import Manifest, SerialEngine
from gristmill.core.units import bits_per_byte
from gristmill.tasks.evaluate import compression
from gristmill.tasks.evaluate.config import fingerprint

# --- pure arithmetic ----------------------------------------------------------------------------

def test_bits_per_byte_hand_computed():
    # A loss of ln(2) nats per token is 1 bit per token = 0.25 bits per byte at 4 bytes per token.
    assert bits_per_byte(math.log(2), 4.0) == pytest.approx(0.25)
    assert bits_per_byte(3.0, 1.0) == pytest.approx(3.0 / math.log(2))
    with pytest.raises(ValueError, match="bytes_per_token"):
        bits_per_byte(1.0, 0.0)


def test_token_bytes_are_exact_even_inside_a_character(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "naïve café — 日本語 text, ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    assert compression.token_bytes(tok, ids) == text.encode()
    # Split after every token: the halves' bytes still add up, though some end inside a character.
    halves = [compression.token_bytes(tok, ids[:i]) + compression.token_bytes(tok, ids[i:])
              for i in range(len(ids))]
    assert set(halves) == {text.encode()}
    assert any(not _decodes(compression.token_bytes(tok, ids[:i])) for i in range(len(ids)))
    sep = tok.convert_tokens_to_ids("<|endoftext|>")  # stands for no text
    assert compression.token_bytes(tok, [sep, *ids, sep]) == text.encode()


def _decodes(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_compressors_given_the_text_they_have_read(shared_data):
    text = (shared_data / "corpus" / "botchan_en.txt").read_bytes()
    scored, unrelated = text[200_000:210_000], text[:100_000]
    alone = compression.baselines(scored, b"")
    assert set(alone) == {"scored_bytes", "train_bytes", "xz_bpb", "zstd_bpb"}
    assert 1.5 < alone["xz_bpb"] < 5 and 1.5 < alone["zstd_bpb"] < 5  # English prose
    # Training text that holds the scored bytes makes them nearly free; unrelated text of the same
    # book helps a little (shared words); random bytes cannot be compressed at all.
    read = compression.baselines(scored, unrelated + scored)
    related = compression.baselines(scored, unrelated)
    for name in ("xz", "zstd"):
        assert read[f"{name}_given_train_bpb"] < 0.1 < related[f"{name}_given_train_bpb"]
        assert related[f"{name}_given_train_bpb"] < alone[f"{name}_bpb"]
    noise = np.random.default_rng(0).bytes(20_000)
    assert compression.baselines(noise, b"")["xz_bpb"] > 8
    with pytest.raises(ValueError, match="no bytes"):
        compression.baselines(b"", text)


def test_eval_windows():
    assert evaluate.eval_windows(1001, seq_len=100, max_eval_tokens=10_000) == (100, 10)
    assert evaluate.eval_windows(1000, seq_len=100, max_eval_tokens=10_000) == (100, 9)  # needs a +1 target
    assert evaluate.eval_windows(1001, seq_len=100, max_eval_tokens=350) == (100, 3)
    assert evaluate.eval_windows(50, seq_len=100, max_eval_tokens=10_000) == (49, 1)  # short split
    with pytest.raises(ValueError):
        evaluate.eval_windows(1, seq_len=100, max_eval_tokens=10)


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValidationError, match="seq_len"):
        evaluate.Config(seq_len=0)
    with pytest.raises(ValidationError, match="tasks"):
        evaluate.Config(tasks=[str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValidationError, match="limit"):
        evaluate.Config(limit=0)
    (tmp_path / "a").mkdir()
    for folder in (tmp_path, tmp_path / "a"):
        (folder / "arc.jsonl").write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n')
    with pytest.raises(ValidationError, match="share a task name"):
        evaluate.Config(tasks=[str(tmp_path / "arc.jsonl"), str(tmp_path / "a" / "arc.jsonl")])
    with pytest.raises(ValidationError):
        evaluate.Config(device="tpu")


def test_fingerprint_follows_file_contents(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n')
    before = fingerprint(evaluate.Config(tasks=[str(path)]))
    path.write_text('{"query": "q", "choices": ["a", "b"], "gold": 1}\n')
    assert fingerprint(evaluate.Config(tasks=[str(path)])) != before
    piqa, labels = tmp_path / "valid.jsonl", tmp_path / "valid-labels.lst"  # PIQA's labels count too
    piqa.write_text('{"goal": "g", "sol1": "a", "sol2": "b"}\n')
    labels.write_text("0\n")
    before = fingerprint(evaluate.Config(tasks=[str(piqa)]))
    labels.write_text("1\n")
    assert fingerprint(evaluate.Config(tasks=[str(piqa)])) != before


# --- the stage on a random tiny model -----------------------------------------------------------

def _fake_tokenize(root: Path, tokenizer_dir: Path, shared_data: Path) -> Manifest:
    """A tokenize-like output: val.bin from real text with the fixture tokenizer, and its meta."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = (shared_data / "corpus" / "botchan_en.txt").read_text(encoding="utf-8-sig")  # no BOM: ASCII, so
    # decoding to str gives the same bytes as compression.token_bytes
    docs = [text[i: i + 1000] for i in range(0, 12_000, 1000)]
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = [t for d in docs for t in [*tok.encode(d, add_special_tokens=False), sep]]
    (root / "tokens").mkdir(parents=True)
    np.asarray(ids, dtype=np.uint16).tofile(root / "tokens" / "val.bin")
    train = tok.encode(text[20_000:60_000], add_special_tokens=False)
    np.asarray(train, dtype=np.uint16).tofile(root / "tokens" / "train.bin")
    tok.save_pretrained(root / "tokenizer")
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


LEAKED_ITEM = 3  # the ARC-Easy item the fake crawl quotes


def _crawl_quoting_arc_easy_item(path: Path, shared_data: Path, index: int) -> Manifest:
    """A collect artifact whose one document copies an ARC-Easy question with its choices."""
    import gzip

    line = (shared_data / "eval" / "arc_easy" / "arc_easy_part1.jsonl").read_text().splitlines()[index]
    item = json.loads(line)
    (path / "docs").mkdir(parents=True)
    with gzip.open(path / "docs" / "part-00000.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "leak", "text": "Quiz of the week! " + item["query"] + " "
                            + " / ".join(item["choices"])}) + "\n")
    return Manifest(stage="collect", key="collect-test", path=path, config={}, upstream={},
                    files={}, stats={})


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory, tiny_model_dir, shared_data):
    root = tmp_path_factory.mktemp("evaluate")
    inputs = {"tokenize": _fake_tokenize(root / "tokenize", tiny_model_dir, shared_data)}
    for stage in ("pretrain", "sft", "align"):
        inputs[stage] = _model_manifest(stage, tiny_model_dir, root)
    inputs["collect"] = _crawl_quoting_arc_easy_item(root / "collect", shared_data, LEAKED_ITEM)
    config = _config(shared_data)
    out = root / "out"
    result = evaluate.run(config, out, engine=SerialEngine(), **inputs)
    return result, out, inputs


def _config(shared_data: Path) -> evaluate.Config:
    tasks = [str(shared_data / "eval" / "arc_easy" / "arc_easy_part1.jsonl"),
             str(shared_data / "eval" / "lambada_openai" / "lambada_openai_part1.jsonl")]
    return evaluate.Config(seq_len=64, max_eval_tokens=640, arith_problems=12, max_new_tokens=6,
                           batch_size=8, tasks=tasks, limit=20, device="cpu")


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


def test_bpb_is_over_the_bytes_of_the_scored_tokens(stage_run):
    result, _, inputs = stage_run
    tok = AutoTokenizer.from_pretrained(inputs["tokenize"].path / "tokenizer")
    ids = np.fromfile(inputs["tokenize"].path / "tokens" / "val.bin", dtype=np.uint16)
    # Tokens 1..640 are the ones predicted (each window's first token is context only).
    n_bytes = len(tok.decode(ids[1:641].tolist(), skip_special_tokens=True).encode())
    assert result.stats["sft_val_bytes_covered"] == n_bytes
    expected = result.stats["sft_val_loss"] * 640 / (math.log(2) * n_bytes)
    assert result.stats["sft_val_bpb"] == pytest.approx(expected)


def test_compressor_baselines_on_the_same_bytes(stage_run):
    result, out, _ = stage_run
    baselines = json.loads((out / "compression.json").read_text())
    assert baselines["scored_bytes"] == result.stats["base_val_bytes_covered"]
    assert baselines["train_bytes"] == 40_000  # the whole (small) train split was read
    for key, value in baselines.items():
        assert result.stats[f"compression_{key}"] == value
    for name in ("xz", "zstd"):  # the same book's other chapters help the compressor (1,170 bytes:
        # the container's header is a good share of the figure alone)
        assert 1.5 < baselines[f"{name}_given_train_bpb"] < baselines[f"{name}_bpb"] < 8
    assert json.loads((out / "results.json").read_text())["compression"] == baselines


def test_task_scores_are_fractions_with_item_counts(stage_run):
    result, out, _ = stage_run
    for label in ("base", "sft", "aligned"):
        assert result.stats[f"{label}_arith_n"] == 12
        acc = result.stats[f"{label}_arith_acc"]
        assert 0.0 <= acc <= 1.0 and (acc * 12) == pytest.approx(round(acc * 12))
        assert result.stats[f"{label}_arc_easy_part1_n"] == 20
        acc = result.stats[f"{label}_arc_easy_part1_acc"]
        assert 0.0 <= acc <= 1.0 and acc * 20 == pytest.approx(round(acc * 20))
        assert result.stats[f"{label}_arc_easy_part1_chance"] == pytest.approx(0.25, abs=0.02)
        assert result.stats[f"{label}_arc_easy_part1_centered_acc"] == pytest.approx((acc - 0.25) / 0.75)
        assert result.stats[f"{label}_core"] == result.stats[f"{label}_arc_easy_part1_centered_acc"]
        assert result.stats[f"{label}_lambada_openai_part1_perplexity"] > 1
        assert result.stats[f"{label}_lambada_openai_part1_n"] == 20
    examples = json.loads((out / "results.json").read_text())["models"]["base"]["arith_examples"]
    assert examples and all("<|im_end|>" not in e["completion"] for e in examples)


def test_stage_writes_results_and_the_contamination_marks(stage_run):
    result, out, _ = stage_run
    assert result.artifacts == ["results.json", "contamination.json", "compression.json"]
    marks = json.loads((out / "contamination.json").read_text())
    # every model read the crawl; its one leaked item is marked for each, and nothing else
    assert marks == {label: {"arc_easy_part1": [LEAKED_ITEM], "lambada_openai_part1": []}
                     for label in ("base", "sft", "aligned")}
    for label in ("base", "sft", "aligned"):
        rows = [json.loads(line) for line in
                (out / "per_model" / label / "tasks" / "arc_easy_part1.items.jsonl").open()]
        clean = [r["correct"] for r in rows if r["id"] != LEAKED_ITEM]
        assert result.stats[f"{label}_arc_easy_part1_contaminated"] == 1
        assert result.stats[f"{label}_arc_easy_part1_n_clean"] == len(rows) - 1 == 19
        assert result.stats[f"{label}_arc_easy_part1_acc_clean"] == pytest.approx(sum(clean) / 19)
        assert result.stats[f"{label}_lambada_openai_part1_contaminated"] == 0
    assert not (out / "report.md").exists()  # the report card is the flow's (flows/report_card.py)


def test_batched_generation_matches_one_at_a_time(tiny_model_dir):
    from gristmill.core.arithmetic import problems
    from gristmill.core.chat import prompt_ids

    model, tok = evaluate.load_model(tiny_model_dir, "cpu")
    prompts = [prompt_ids(tok, [{"role": "user", "content": p.question}])
               for p in problems("test", 4, seed=1)]
    prompts.append(prompt_ids(tok, [{"role": "user", "content": "What is 12 + 7? Explain."}]))
    batched = evaluate.generate_greedy(model, tok, prompts, max_new_tokens=5, device="cpu")
    single = [evaluate.generate_greedy(model, tok, [p], max_new_tokens=5, device="cpu")[0] for p in prompts]
    assert batched == single


def test_arithmetic_accuracy_counts_correct_answers(monkeypatch, tiny_model_dir):
    """With generation stubbed to answer only even-valued problems correctly, accuracy is their share."""
    import gristmill.core.arithmetic as arithmetic

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


def test_a_killed_run_resumes_per_model_and_per_task(stage_run, shared_data, monkeypatch):
    """With the SFT model's LAMBADA result gone (killed mid-task), a re-run scores that one task
    of that one model again and reuses everything else; the stats come out the same."""
    result, out, inputs = stage_run
    before = dict(result.stats)
    (out / "per_model" / "sft" / "tasks" / "lambada_openai_part1.json").unlink()
    (out / "per_model" / "sft.json").unlink()
    calls = []
    real = evaluate.evaluate_task
    monkeypatch.setattr(evaluate, "evaluate_task", lambda *a, **k: calls.append(a[2].name) or real(*a, **k))
    again = evaluate.run(_config(shared_data), out, engine=SerialEngine(), **inputs)
    assert calls == ["lambada_openai_part1"]
    assert again.stats == pytest.approx(before)
    rows = (out / "per_model" / "sft" / "tasks" / "lambada_openai_part1.items.jsonl").read_text().splitlines()
    assert len(rows) == 20 and json.loads(rows[0])["task"] == "lambada_openai_part1"
