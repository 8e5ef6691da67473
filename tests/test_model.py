"""model/: LR schedule, presets, the training loop's checkpoints and exact resume, export."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from model.export import export_model
from model.loop import (IGNORE_INDEX, LoopConfig, causal_lm_loss, complete_checkpoints,
                        mean_token_loss, train)
from model.presets import ModelConfig, build_model
from model.schedule import warmup_cosine
from tasks.chat import DOC_SEPARATOR, IM_END
from tasks.stage import MetricsLog, read_metrics

TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_seq_len=64)


# --- schedule ---------------------------------------------------------------------------------

def test_warmup_is_linear_and_starts_above_zero():
    assert warmup_cosine(0, 100, 0.1, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(4, 100, 0.1, 0.1) == pytest.approx(0.5)
    assert warmup_cosine(9, 100, 0.1, 0.1) == pytest.approx(1.0)


def test_cosine_decays_from_peak_to_floor():
    assert warmup_cosine(10, 100, 0.1, 0.1) == pytest.approx(1.0)  # first step after warmup
    assert warmup_cosine(99, 100, 0.1, 0.1) == pytest.approx(0.1)  # last step sits on the floor
    assert warmup_cosine(10, 21, 0.0, 0.0) == pytest.approx(0.5)  # halfway through the decay
    assert warmup_cosine(15, 21, 0.0, 0.2) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.75)))
    assert warmup_cosine(500, 100, 0.1, 0.1) == pytest.approx(0.1)  # past the end: stays on the floor


def test_schedule_without_warmup_starts_at_peak():
    assert warmup_cosine(0, 50, 0.0, 0.1) == pytest.approx(1.0)


# --- presets ----------------------------------------------------------------------------------

def test_model_config_validation_names_the_field():
    with pytest.raises(ValidationError, match="num_heads"):
        ModelConfig(hidden_size=100, num_heads=3)
    with pytest.raises(ValidationError, match="hidden_sise"):
        ModelConfig(hidden_sise=64)
    with pytest.raises(ValidationError, match="grad_accum_steps"):
        LoopConfig(batch_size=6, grad_accum_steps=4)


def test_build_model_matches_tokenizer(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model = build_model(TINY, tok)
    assert model.config.vocab_size == len(tok)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == "sdpa"
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert model.config.num_hidden_layers == 2 and model.config.max_position_embeddings == 64


# --- loop -------------------------------------------------------------------------------------

def _random_batch(step: int, vocab: int = 200, rows: int = 4, seq_len: int = 16) -> dict:
    x = torch.randint(0, vocab, (rows, seq_len + 1), generator=torch.Generator().manual_seed(step))
    return {"input_ids": x[:, :-1], "labels": x[:, 1:]}


def _fit(tok, work_dir: Path, max_steps: int, crash_at: int | None = None, **overrides) -> dict:
    torch.manual_seed(0)
    model = build_model(TINY, tok)

    def get_batch(step: int) -> dict:
        if step == crash_at:
            raise RuntimeError("simulated crash")
        return _random_batch(step)

    cfg = LoopConfig(**{"max_steps": max_steps, "batch_size": 4, "checkpoint_every": 2, "log_every": 100,
                        "keep_checkpoints": 2, **overrides})
    work_dir.mkdir(exist_ok=True)
    return train(model, get_batch, cfg, work_dir, MetricsLog(work_dir),
                 evaluate=lambda m: {"val_loss": mean_token_loss(m, [_random_batch(10_000)])})


def _losses(work_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(work_dir / "metrics.jsonl")]


def test_resume_after_crash_reproduces_every_loss(tiny_tokenizer_dir, tmp_path, caplog):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    straight = _fit(tok, tmp_path / "a", 6)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tok, tmp_path / "b", 6, crash_at=5)
    assert [s for s, _ in complete_checkpoints(tmp_path / "b")] == [2, 4]
    with caplog.at_level(logging.INFO, logger="gristmill.train"):
        resumed = _fit(tok, tmp_path / "b", 6)
    assert "resuming from step 4" in caplog.text
    assert resumed["resumed_from_step"] == 4 and straight["resumed_from_step"] == 0
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")  # exact, step for step
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == list(range(1, 7))
    assert resumed["val_loss"] == straight["val_loss"]
    assert resumed["tokens_seen"] == straight["tokens_seen"] == 6 * 4 * 16
    assert [s for s, _ in complete_checkpoints(tmp_path / "b")] == [4, 6]  # keep_checkpoints=2
    # A crash after training (e.g. during export): the re-run trains nothing and logs nothing new.
    again = _fit(tok, tmp_path / "b", 6)
    assert again["resumed_from_step"] == 6 and again["val_loss"] == straight["val_loss"]
    assert again["final_train_loss"] == straight["final_train_loss"]
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")


def test_non_finite_loss_fails_naming_the_step(tiny_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model = build_model(TINY, tok)
    cfg = LoopConfig(max_steps=3, batch_size=4)
    with pytest.raises(FloatingPointError, match="step 1"):
        train(model, _random_batch, cfg, tmp_path, MetricsLog(tmp_path),
              loss_fn=lambda m, b: causal_lm_loss(m, b) * float("nan"))


def test_checkpoint_without_marker_is_ignored(tiny_tokenizer_dir, tmp_path, caplog):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    with pytest.raises(RuntimeError):
        _fit(tok, tmp_path, 6, crash_at=3)
    # A later checkpoint whose save was interrupted: files but no completion marker.
    torn = tmp_path / "checkpoints" / "step-0000006"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"garbage")
    with caplog.at_level(logging.INFO, logger="gristmill.train"):
        summary = _fit(tok, tmp_path, 6)
    assert "resuming from step 2" in caplog.text and summary["resumed_from_step"] == 2
    assert json.loads((tmp_path / "checkpoints" / "step-0000006" / "checkpoint.json").read_text())["step"] == 6


def test_training_lowers_loss_and_changes_parameters(tiny_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(TINY, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fixed = _random_batch(0)  # one batch, memorised: loss must fall fast
    cfg = LoopConfig(max_steps=20, batch_size=4, lr=1e-2, warmup_frac=0.0, checkpoint_every=100)
    train(model, lambda step: fixed, cfg, tmp_path, MetricsLog(tmp_path))
    losses = _losses(tmp_path)
    assert losses[-1] < 0.7 * losses[0]
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "model.embed_tokens.weight" in changed and "model.layers.1.mlp.up_proj.weight" in changed


def test_gradient_accumulation_matches_full_batch(tiny_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    runs = [_fit(tok, tmp_path / f"accum{k}", 3, grad_accum_steps=k) for k in (1, 2)]
    assert _losses(tmp_path / "accum1") == pytest.approx(_losses(tmp_path / "accum2"), rel=1e-4)
    assert runs[0]["val_loss"] == pytest.approx(runs[1]["val_loss"], rel=1e-4)


def test_loss_ignores_masked_labels(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(TINY, tok)
    batch = _random_batch(1, rows=1)
    masked = {**batch, "labels": batch["labels"].clone()}
    masked["labels"][:, :8] = IGNORE_INDEX
    logits = model(input_ids=batch["input_ids"]).logits[0, 8:]
    expected = torch.nn.functional.cross_entropy(logits, batch["labels"][0, 8:])
    assert causal_lm_loss(model, masked).item() == pytest.approx(expected.item(), rel=1e-5)


# --- export -----------------------------------------------------------------------------------

def test_export_loads_with_auto_classes_and_generates(tiny_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(TINY, tok)
    out = export_model(model, tok, tmp_path / "model")
    assert not list(out.glob("*.bin")) and (out / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    loaded_tok = AutoTokenizer.from_pretrained(out)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(DOC_SEPARATOR)]
    assert gen["pad_token_id"] == tok.pad_token_id
    assert loaded_tok.chat_template == tok.chat_template and loaded_tok.chat_template
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = loaded_tok("To be", return_tensors="pt").input_ids
    out_ids = loaded.generate(ids, max_new_tokens=5, do_sample=False)
    assert out_ids.shape[1] > ids.shape[1]
    export_model(model, tok, out)  # re-export over a previous (e.g. torn) export
    assert (out / "model.safetensors").is_file()
