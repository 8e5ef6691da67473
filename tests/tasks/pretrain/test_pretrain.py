"""Pretrain stage on real text: loss falls, resume after a crash is exact, the export loads."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from train_helpers import MODEL, pretrain_config, untimed, write_tokens
from transformers import AutoModelForCausalLM, AutoTokenizer

import gristmill.tasks.pretrain.stage as pretrain
from gristmill.core.stage import Manifest, SerialEngine, read_metrics
from gristmill.model.presets import ModelConfig, build_model


@pytest.fixture(scope="module")
def tokenize_manifest(tmp_path_factory, tiny_tokenizer_dir, shared_data) -> Manifest:
    root = tmp_path_factory.mktemp("tokenize")
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.save_pretrained(root / "tokenizer")
    speeches = sorted((shared_data / "corpus" / "nltk_inaugural").glob("17*.txt"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in speeches]
    write_tokens(tokenizer, {"train": texts[1:], "val": texts[:1]}, root / "tokens")
    return Manifest(stage="tokenize", key="test", path=root, config={}, upstream={}, files={}, stats={})




def test_config_validation_names_the_field():
    with pytest.raises(ValidationError, match="seq_len"):
        pretrain_config(seq_len=128)
    with pytest.raises(ValidationError, match="max_stepz"):
        pretrain.Config(max_stepz=3)
    assert "checkpoint_every" not in pretrain_config().hashed_dict() and "seed" in pretrain_config().hashed_dict()


def test_batches_are_a_pure_function_of_seed_and_step():
    data = np.arange(1000, dtype=np.uint16)
    a = pretrain.train_starts(len(data), 32, 4, seed=0, step=7)
    assert np.array_equal(a, pretrain.train_starts(len(data), 32, 4, seed=0, step=7))
    assert not np.array_equal(a, pretrain.train_starts(len(data), 32, 4, seed=0, step=8))
    assert not np.array_equal(a, pretrain.train_starts(len(data), 32, 4, seed=1, step=7))
    batch = pretrain.windows_batch(data, a, 32)
    assert batch["input_ids"].shape == (4, 32)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])  # next-token targets
    assert batch["input_ids"][0, 0].item() == a[0]


def test_pretrain_lowers_loss_and_exports_a_loadable_model(tokenize_manifest, tmp_path):
    config = pretrain_config()
    result = pretrain.run(config, tmp_path, engine=SerialEngine(), store_mapping=None, tokenize=tokenize_manifest)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    losses = [r["loss"] for r in rows]
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 30]
    assert vals[-1] < vals[0] < math.log(1024) + 1
    stats = result.stats
    assert stats["val_loss"] == vals[-1] and stats["steps"] == 30 and stats["resumed_from_step"] == 0
    assert stats["tokens_seen"] == 30 * 8 * 32 and stats["tokens_per_s"] > 0
    assert [r["step"] for r in rows if "tokens_per_s" in r] == [10, 20, 30] and "mfu" not in stats  # CPU
    assert stats["world_size"] == 1 and stats["rollbacks"] == 0
    meta = json.loads((tokenize_manifest.path / "tokens" / "meta.json").read_text())
    assert stats["val_bpb"] == pytest.approx(vals[-1] * meta["val_tokens"] / (math.log(2) * meta["val_bytes"]))
    assert not (tmp_path / "checkpoints").exists()

    model_dir = tmp_path / "model"
    torch.manual_seed(config.seed)
    initial = build_model(ModelConfig(**MODEL), AutoTokenizer.from_pretrained(model_dir))
    trained = load_file(model_dir / "model.safetensors")
    assert not torch.equal(trained["model.embed_tokens.weight"], initial.model.embed_tokens.weight)
    assert stats["params"] == sum(p.numel() for p in initial.parameters())

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.chat_template
    ids = tok("Fellow citizens", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]


def test_unigram_baseline():
    train = np.array([0, 0, 0, 1], dtype=np.uint16)
    # add-one counts: 4, 2, 1 of 7 (vocab 3)
    assert pretrain.unigram_loss(train, np.array([0, 1], dtype=np.uint16), 3) == pytest.approx(
        -(math.log(4 / 7) + math.log(2 / 7)) / 2)


def test_tokens_per_step_derives_accumulation():
    config = pretrain_config(batch_size=4, tokens_per_step=4 * 32 * 2)
    resolved = config.with_seq_len(config.seq_len)
    assert (resolved.batch_size, resolved.grad_accum_steps) == (8, 2) and isinstance(resolved, pretrain.Config)
    with pytest.raises(ValidationError, match="tokens_per_step"):
        pretrain_config(batch_size=4, tokens_per_step=100)


def test_loss_falls_well_below_the_unigram_baseline(shared_data, tiny_tokenizer_dir, tmp_path):
    """Real text (tinyshakespeare, held-out tail as val): the model must use context."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()
    docs = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    tokenizer.save_pretrained(tmp_path / "tok" / "tokenizer")
    write_tokens(tokenizer, {"train": docs[:-40], "val": docs[-40:]}, tmp_path / "tok" / "tokens")
    manifest = Manifest(stage="tokenize", key="t", path=tmp_path / "tok", config={}, upstream={}, files={}, stats={})
    config = pretrain_config(seq_len=64, batch_size=16, max_steps=150, lr=1e-2, val_windows=64, eval_every=0,
                     checkpoint_every=1000, log_every=50)
    stats = pretrain.run(config, tmp_path / "out", engine=SerialEngine(), store_mapping=None, tokenize=manifest).stats
    assert 4.5 < stats["unigram_val_loss"] < 7  # a 1024-token BPE on English: about 5.5 nats
    assert stats["val_loss"] < stats["unigram_val_loss"] - 0.5, stats
    assert stats["val_bpb"] < stats["unigram_val_bpb"]


def test_resume_after_crash_is_exact(tokenize_manifest, tmp_path, monkeypatch, caplog):
    inputs = {"tokenize": tokenize_manifest}
    config = pretrain_config(max_steps=6, checkpoint_every=2, eval_every=3)
    pretrain.run(config, tmp_path / "straight", engine=SerialEngine(), store_mapping=None, **inputs)

    real_starts = pretrain.train_starts

    def crashing_starts(n_tokens, seq_len, batch_size, seed, step):
        if step == 3:
            raise RuntimeError("simulated crash")
        return real_starts(n_tokens, seq_len, batch_size, seed, step)

    monkeypatch.setattr(pretrain, "train_starts", crashing_starts)
    with pytest.raises(RuntimeError, match="simulated crash"):
        pretrain.run(config, tmp_path / "resumed", engine=SerialEngine(), store_mapping=None, **inputs)
    monkeypatch.setattr(pretrain, "train_starts", real_starts)
    caplog.set_level(logging.WARNING, logger="accelerate")
    with caplog.at_level(logging.INFO, logger="gristmill.pretrain"):
        result = pretrain.run(config, tmp_path / "resumed", engine=SerialEngine(), store_mapping=None, **inputs)

    assert "resuming from step 2" in caplog.text and result.stats["resumed_from_step"] == 2
    assert "Removed shared tensor" not in caplog.text  # accelerate's notice at every checkpoint (model/loop.py)
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert untimed(resumed) == untimed(straight)  # every step's loss, lr, grad norm and val loss, exactly
    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
