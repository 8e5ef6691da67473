"""model/: LR schedule, presets, the training loop's checkpoints and exact resume, export."""
from __future__ import annotations

import errno
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from gristmill.core import files
from gristmill.core.chat import DOC_SEPARATOR, IM_END
from gristmill.core.files import DiskSpaceError
from gristmill.core.stage import MetricsLog, read_metrics
from gristmill.model import checkpoint
from gristmill.model.checkpoint import checkpoint_place
from gristmill.model.export import export_model
from gristmill.model.loop import (
    IGNORE_INDEX,
    LoopConfig,
    TrainingDiverged,
    causal_lm_loss,
    make_optimizer,
    mean_token_loss,
    train,
)
from gristmill.model.presets import (
    PLAN_VOCAB_SIZE,
    PRESETS,
    ModelConfig,
    build_model,
    config_params,
    count_params,
    preset,
)
from gristmill.model.schedule import lr_multiplier, warmup_cosine, warmup_stable_decay

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


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly():
    lrs = [warmup_stable_decay(s, 100, 0.1, 0.2, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # same warmup as cosine
    assert lrs[10:80] == [1.0] * 70  # stable phase
    assert lrs[80] == pytest.approx(1 - 0.9 / 20) and lrs[89] == pytest.approx(1 - 0.9 * 10 / 20)
    assert lrs[99] == pytest.approx(0.1)  # the floor at the last step
    assert warmup_stable_decay(50, 100, 0.0, 0.0, 0.1) == 1.0  # no decay phase
    assert lr_multiplier(95, 100, "wsd", 0.1, 0.2, 0.1) == lrs[95]
    assert lr_multiplier(50, 100, "cosine", 0.1, 0.2, 0.1) == warmup_cosine(50, 100, 0.1, 0.1)
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, 10, "linear", 0.1, 0.2, 0.1)


# --- presets ----------------------------------------------------------------------------------

def test_model_config_validation_names_the_field():
    with pytest.raises(ValidationError, match="num_heads"):
        ModelConfig(hidden_size=100, num_heads=3)
    with pytest.raises(ValidationError, match="hidden_sise"):
        ModelConfig(hidden_sise=64)
    with pytest.raises(ValidationError, match="grad_accum_steps"):
        LoopConfig(batch_size=6, grad_accum_steps=4)
    with pytest.raises(ValidationError, match="tokens_per_step"):
        LoopConfig(tokens_per_step=4096, grad_accum_steps=2)
    with pytest.raises(ValidationError, match="schedule"):
        LoopConfig(schedule="linear")


def test_tokens_per_step_sets_accumulation():
    cfg = LoopConfig(batch_size=4, tokens_per_step=4 * 64 * 3).with_seq_len(64)
    assert (cfg.batch_size, cfg.grad_accum_steps, cfg.tokens_per_step) == (12, 3, None)
    assert LoopConfig(batch_size=4).with_seq_len(64) == LoopConfig(batch_size=4)
    with pytest.raises(ValueError, match="tokens_per_step"):
        LoopConfig(batch_size=4, tokens_per_step=1000).with_seq_len(64)


def test_each_process_runs_batch_size_sequences_per_forward_whatever_the_process_count():
    """The global batch is tokens_per_step; the accumulation is what is left after the processes."""
    gpu = LoopConfig(batch_size=16, tokens_per_step=8 * 16 * 2048)
    for world, accum in [(8, 1), (4, 2), (1, 8)]:
        cfg = gpu.with_seq_len(2048, world)
        assert (cfg.batch_size, cfg.grad_accum_steps) == (8 * 16, accum)
        assert cfg.batch_size // world // cfg.grad_accum_steps == 16  # rows per forward, per process
    with pytest.raises(ValueError, match=r"processes \* batch_size \* seq_len = 3 \* 16 \* 2048"):
        gpu.with_seq_len(2048, 3)


def test_peaks_by_exact_device_name_and_an_unknown_one_reports_no_mfu(caplog):
    from gristmill.model.throughput import peak_tflops_of

    assert peak_tflops_of("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_of("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_of("NVIDIA H100 NVL") == 835.0
    assert peak_tflops_of("NVIDIA A100-SXM4-40GB") == peak_tflops_of("NVIDIA A100 80GB PCIe") == 312.0
    assert peak_tflops_of("NVIDIA B200") == 2250.0 and peak_tflops_of("NVIDIA L40S") == 362.0
    with caplog.at_level(logging.WARNING, logger="gristmill.throughput"):
        assert peak_tflops_of("NVIDIA H100 Something New") is None
    assert len(caplog.records) == 1 and "peak_tflops" in caplog.text


def test_muon_orthogonalises_in_fp32_on_a_cpu():
    """Newton-Schulz in fp32 on a CPU (bf16 there is tens of times slower without native support,
    and rounds the update to 3 digits): the update equals an fp64 run of the same iteration."""
    from gristmill.model.optim import Muon, newton_schulz_dtype, orthogonalise

    assert newton_schulz_dtype(torch.device("cpu")) == torch.float32
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 32))
    weight.grad = torch.randn(48, 32)
    before = weight.detach().clone()
    Muon([weight], lr=0.1, weight_decay=0.0, momentum=0.95, ns_dtype=newton_schulz_dtype(torch.device("cpu"))).step()
    nesterov = weight.grad.lerp(0.05 * weight.grad, 0.95)  # the first step's momentum buffer is 0.05 * grad
    expected = orthogonalise(nesterov.double(), torch.float64).float() * 0.1 * 0.2 * math.sqrt(48)
    assert torch.allclose(before - weight.detach(), expected, atol=1e-5, rtol=0)
    bf16 = orthogonalise(nesterov, torch.bfloat16) * 0.1 * 0.2 * math.sqrt(48)
    assert not torch.allclose(bf16, expected, atol=1e-5, rtol=0)  # the check above can tell the two apart


def test_the_compiled_training_graph_is_not_recompiled_by_evaluation(tiny_tokenizer_dir, tmp_path):
    """compile: each decoder block compiled once (one graph for every block); evaluation runs eager."""
    from torch._dynamo.utils import counters

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(TINY, tok)
    batch = {"input_ids": torch.randint(0, len(tok), (4, 32)), "labels": torch.randint(0, len(tok), (4, 32))}
    counters.clear()
    seen = []

    def evaluate(m):
        seen.append(counters["stats"]["unique_graphs"])
        loss = mean_token_loss(m, [batch])
        seen.append(counters["stats"]["unique_graphs"])
        return {"val_loss": loss}

    cfg = LoopConfig(max_steps=3, eval_every=1, compile=True, checkpoint_every=10, max_rollbacks=0, lr=1e-3)
    train(model, lambda i: batch, cfg, checkpoint_place(tmp_path, None), MetricsLog(tmp_path), evaluate=evaluate)
    assert seen[0] >= 1 and len(set(seen)) == 1, seen  # no graph compiled by or after an evaluation
    assert counters["stats"]["unique_graphs"] <= 2  # the blocks' forward (+ its backward), once for all blocks


def test_presets_count_parameters_of_the_built_model(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    for cfg in (TINY, PRESETS["tiny"]):
        assert config_params(cfg, len(tok)) == count_params(build_model(cfg, tok))
    sizes = {name: config_params(cfg, PLAN_VOCAB_SIZE) for name, cfg in PRESETS.items()}
    assert 110e6 < sizes["125m"] < 140e6 and 0.9e9 < sizes["1b"] < 1.2e9 and 6.3e9 < sizes["7b"] < 7.0e9
    assert sizes["tiny"] < 10e6
    assert preset("125m").hidden_size == 768
    with pytest.raises(ValueError, match="known: tiny, 125m, 1b, 7b"):
        preset("3b")


def test_optimizer_is_fused_only_on_cuda(tiny_tokenizer_dir):
    model = build_model(TINY, AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    assert not make_optimizer(model, LoopConfig()).defaults["fused"]


def test_muon_trains_the_blocks_matrices_and_adamw_the_rest(tiny_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model = build_model(TINY, tok)
    optimizer = make_optimizer(model, LoopConfig(optimizer="muon", weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for g in optimizer.parts["muon"].param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in optimizer.parts["adamw"].param_groups for p in g["params"]}
    assert on_muon | on_adamw == set(names.values()) and not on_muon & on_adamw
    assert on_muon and all(".layers." in n and n.endswith("proj.weight") for n in on_muon)
    assert "model.embed_tokens.weight" in on_adamw and any("norm" in n for n in on_adamw)
    no_decay = [g for g in optimizer.parts["adamw"].param_groups if g["weight_decay"] == 0.0]
    assert all(p.dim() == 1 for g in no_decay for p in g["params"])
    # One set of group dicts: what the LR schedule writes reaches both halves, after a reload too.
    assert optimizer.param_groups == optimizer.parts["muon"].param_groups + optimizer.parts["adamw"].param_groups
    optimizer.load_state_dict(optimizer.state_dict())
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    assert {g["lr"] for g in optimizer.parts["muon"].param_groups + optimizer.parts["adamw"].param_groups} == {0.5}


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
    return train(model, get_batch, cfg, checkpoint_place(work_dir, None), MetricsLog(work_dir),
                 evaluate=lambda m: {"val_loss": mean_token_loss(m, [_random_batch(10_000)])})


def _untimed(rows: list[dict]) -> list[dict]:
    """Metric rows without the wall-clock ones (tokens_per_s, mfu, checkpoint_s), which no two runs share."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "checkpoint_s")} for r in rows]


def _losses(work_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(work_dir / "metrics.jsonl")]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_crash_reproduces_every_loss(tiny_tokenizer_dir, tmp_path, caplog, optimizer):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    straight = _fit(tok, tmp_path / "a", 6, optimizer=optimizer)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tok, tmp_path / "b", 6, crash_at=5, optimizer=optimizer)
    assert [s for s, _ in checkpoint_place(tmp_path / "b", None).complete()] == [2, 4]
    with caplog.at_level(logging.INFO, logger="gristmill.train"):
        resumed = _fit(tok, tmp_path / "b", 6, optimizer=optimizer)
    assert "resuming from step 4" in caplog.text
    assert resumed["resumed_from_step"] == 4 and straight["resumed_from_step"] == 0
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")  # exact, step for step
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == list(range(1, 7))
    assert resumed["val_loss"] == straight["val_loss"]
    assert resumed["tokens_seen"] == straight["tokens_seen"] == 6 * 4 * 16
    assert [s for s, _ in checkpoint_place(tmp_path / "b", None).complete()] == [4, 6]  # keep_checkpoints=2
    # A crash after training (e.g. during export): the re-run trains nothing and logs nothing new.
    again = _fit(tok, tmp_path / "b", 6, optimizer=optimizer)
    assert again["resumed_from_step"] == 6 and again["val_loss"] == straight["val_loss"]
    assert again["final_train_loss"] == straight["final_train_loss"]
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")


def test_resume_unpickles_nothing_and_skips_a_damaged_checkpoint(tiny_tokenizer_dir, tmp_path, monkeypatch, caplog):
    """Checkpoints carry every file's sha256: flipped or truncated bytes in the newest one are
    found on resume, which then starts from the one before it and still ends where a run that
    never stopped ends. Nothing is loaded with weights_only=False, the scheduler is JSON."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    straight = _fit(tok, tmp_path / "a", 6)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tok, tmp_path / "b", 6, crash_at=5)
    (step2, _), (step4, newest) = checkpoint_place(tmp_path / "b", None).complete()
    assert (step2, step4) == (2, 4) and (newest / "scheduler.json").is_file()
    assert not list(newest.glob("custom_checkpoint_*"))
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))

    real_load = torch.load

    def guarded_load(*args, **kwargs):
        assert kwargs.get("weights_only", True) is True, f"unpickling {args[:1]} with weights_only=False"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", guarded_load)
    with caplog.at_level(logging.WARNING, logger="gristmill.checkpoint"):
        resumed = _fit(tok, tmp_path / "b", 6)
    assert "model.safetensors does not match its sha256" in caplog.text
    assert resumed["resumed_from_step"] == 2 and checkpoint.damage(newest) is None  # deleted, then rewritten
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a") and resumed["val_loss"] == straight["val_loss"]
    # a truncated file is found by its size
    _, last = checkpoint_place(tmp_path / "b", None).complete()[-1]
    (last / "model.safetensors").write_bytes((last / "model.safetensors").read_bytes()[:100])
    assert "bytes" in checkpoint.damage(last)


def test_checkpoint_needs_free_space_and_a_full_disk_keeps_the_earlier_ones(tiny_tokenizer_dir, tmp_path, monkeypatch):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    _fit(tok, tmp_path / "run", 4, max_rollbacks=0)
    before = checkpoint_place(tmp_path / "run", None).complete()
    assert [s for s, _ in before] == [2, 4]

    def full_disk(directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskSpaceError, match=r"disk full while writing a checkpoint to .*tmp-step-0000006"):
        checkpoint.save_checkpoint(checkpoint_place(tmp_path / "run", None), {"step": 6}, 2, full_disk)
    assert checkpoint_place(tmp_path / "run", None).complete() == before
    assert not list((tmp_path / "run" / "checkpoints").glob("tmp-*"))

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    needs = r"not enough free disk space for a checkpoint in .*run/checkpoints: needs about"
    with pytest.raises(DiskSpaceError, match=needs):
        _fit(tok, tmp_path / "run", 6, max_rollbacks=0)
    assert checkpoint_place(tmp_path / "run", None).complete() == before


def test_non_finite_loss_fails_naming_the_step(tiny_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model = build_model(TINY, tok)
    cfg = LoopConfig(max_steps=3, batch_size=4, max_rollbacks=0)
    with pytest.raises(TrainingDiverged, match=r"nan \(non-finite\) at step 1 after 0 rollbacks"):
        train(model, _random_batch, cfg, checkpoint_place(tmp_path, None), MetricsLog(tmp_path),
              loss_fn=lambda m, b: causal_lm_loss(m, b) * float("nan"))


def _poisoned_fit(tok, work_dir: Path, poison, factor: float, crash_at: int | None = None, **overrides):
    """Train on random batches; the loss of batch indices in `poison` is multiplied by `factor`."""
    torch.manual_seed(0)
    model = build_model(TINY, tok)

    def get_batch(index: int) -> dict:
        if index == crash_at:
            raise RuntimeError("simulated crash")
        batch = _random_batch(index)
        return {**batch, "poison": torch.full((4, 1), index in poison)}

    def loss_fn(m, batch):
        loss = causal_lm_loss(m, batch)
        return loss * factor if batch["poison"].any() else loss

    cfg = LoopConfig(**{"max_steps": 10, "batch_size": 4, "checkpoint_every": 3, "log_every": 100, "lr": 1e-3,
                        "spike_zscore": 6.0, "spike_window": 4, "max_rollbacks": 2, **overrides})
    work_dir.mkdir(exist_ok=True)
    return train(model, get_batch, cfg, checkpoint_place(work_dir, None), MetricsLog(work_dir), loss_fn=loss_fn)


def test_loss_spike_rolls_back_skips_batches_and_resumes_exactly(tiny_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    clean = _poisoned_fit(tok, tmp_path / "clean", poison=(), factor=1.0)
    spiked = _poisoned_fit(tok, tmp_path / "spiked", poison={7}, factor=1e4)  # step 8 reads batch 7
    rows = read_metrics(tmp_path / "spiked" / "metrics.jsonl")
    events = [r for r in rows if "rollback" in r]
    assert events == [{"step": 6, "rollback": 1, "rollback_from_step": 8, "rollback_skipped": 2,
                       "rollback_nonfinite": 0, "rollback_loss": events[0]["rollback_loss"],
                       "rollback_reason": "spike"}]
    assert events[0]["rollback_loss"] > 1e3
    losses = [r["loss"] for r in rows if "loss" in r]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 11))
    assert losses[:6] == _losses(tmp_path / "clean")[:6]  # identical up to the rollback target
    assert max(losses) < 10 and spiked["rollbacks"] == 1 and clean["rollbacks"] == 0
    assert json.loads((tmp_path / "spiked" / "checkpoints" / "step-0000010" / "checkpoint.json").read_text()
                      )["skip_offset"] == 2
    # Killed after the rollback (step 9 reads batch 10), resumed: the same curve, step for step.
    with pytest.raises(RuntimeError, match="simulated crash"):
        _poisoned_fit(tok, tmp_path / "resumed", poison={7}, factor=1e4, crash_at=10)
    resumed = _poisoned_fit(tok, tmp_path / "resumed", poison={7}, factor=1e4)
    assert resumed["resumed_from_step"] == 6 and resumed["rollbacks"] == 1
    assert _untimed(read_metrics(tmp_path / "resumed" / "metrics.jsonl")) == _untimed(rows)


def test_non_finite_losses_roll_back_until_max_rollbacks(tiny_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    # Batch 1 is NaN (batches 0-1 skipped); step 4 reads batch 5, NaN from there on: two rollbacks, then stop.
    with pytest.raises(TrainingDiverged, match=r"non-finite\) at step \d+ after 2 rollbacks \(max_rollbacks=2\)"):
        _poisoned_fit(tok, tmp_path, poison={1, *range(5, 100)}, factor=float("nan"), spike_zscore=0.0)
    events = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "rollback" in r]
    assert [(e["step"], e["rollback_from_step"], e["rollback_nonfinite"]) for e in events] == [(0, 2, 1), (3, 4, 1)]


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


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_lowers_loss_and_changes_parameters(tiny_tokenizer_dir, tmp_path, optimizer):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(TINY, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fixed = _random_batch(0)  # one batch, memorised: loss must fall fast
    cfg = LoopConfig(max_steps=20, batch_size=4, lr=1e-2, warmup_frac=0.0, checkpoint_every=100,
                     optimizer=optimizer)
    train(model, lambda step: fixed, cfg, checkpoint_place(tmp_path, None), MetricsLog(tmp_path))
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



@pytest.mark.parametrize("masks", [True, False], ids=["boolean-mask", "shared-positions"])
def test_logits_of_scored_positions_only_give_the_full_loss_and_gradients(tiny_tokenizer_dir, monkeypatch, masks):
    """token_loss_sum projects only labelled positions onto the vocabulary (SFT: the assistant
    tokens); loss and every gradient equal those of logits at every position, padding included.
    Both ways: a boolean mask, and (transformers 5.17) the positions scored in any row."""
    from gristmill.model import loop

    monkeypatch.setattr(loop, "_masks_logits", lambda: masks)
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(TINY, tok)
    batch = _random_batch(2, rows=3)
    batch = {**batch, "labels": batch["labels"].clone(), "attention_mask": torch.ones(3, 16, dtype=torch.long)}
    batch["labels"][:, :5] = IGNORE_INDEX  # a prompt
    batch["labels"][1, 11:] = IGNORE_INDEX  # a shorter row, right-padded
    batch["attention_mask"][1, 11:] = 0

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    full = torch.nn.functional.cross_entropy(
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.flatten(0, 1),
        batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    expected = grads(full)
    loss = causal_lm_loss(model, batch)
    assert loss.item() == pytest.approx(full.item(), rel=1e-5)
    for got, want in zip(grads(loss), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


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
