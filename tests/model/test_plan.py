"""Compute planning and `gristmill plan`: Chinchilla tokens, 6*N*D FLOPs, GPU-hours, cost."""
from __future__ import annotations

import pytest

from gristmill.flows.cli import main
from gristmill.model.plan import flops_per_token, mfu, plan
from gristmill.model.presets import PLAN_VOCAB_SIZE, PRESETS, config_params


def test_default_plan_is_chinchilla_optimal():
    p = plan(PRESETS["125m"], mfu=0.5, peak_tflops=1000.0, price_per_gpu_hour=2.0)
    n = config_params(PRESETS["125m"], PLAN_VOCAB_SIZE)
    assert p.params == n and p.tokens == p.chinchilla_tokens == 20 * n
    assert p.flops == pytest.approx(6 * n * 20 * n)
    assert p.gpu_hours == pytest.approx(p.flops / (0.5 * 1000e12) / 3600)
    assert p.cost == pytest.approx(2.0 * p.gpu_hours)


def test_gpu_hour_budget_buys_tokens_and_round_trips():
    p = plan(PRESETS["1b"], gpu_hours=100.0, mfu=0.4, peak_tflops=989.0)
    assert p.gpu_hours == pytest.approx(100.0)
    assert p.tokens == pytest.approx(100 * 3600 * 0.4 * 989e12 / (6 * p.params))
    assert plan(PRESETS["1b"], tokens=p.tokens, mfu=0.4).gpu_hours == pytest.approx(100.0)


def test_plan_rejects_bad_budgets_naming_them():
    with pytest.raises(ValueError, match="not both"):
        plan(PRESETS["tiny"], tokens=1e9, gpu_hours=1.0)
    with pytest.raises(ValueError, match="mfu"):
        plan(PRESETS["tiny"], mfu=1.5)
    with pytest.raises(ValueError, match="gpu_hours"):
        plan(PRESETS["tiny"], gpu_hours=-1.0)


def test_flops_per_token_and_mfu():
    cfg = PRESETS["125m"]
    assert flops_per_token(cfg, 32_000) == 6 * config_params(cfg, 32_000)
    assert flops_per_token(cfg, 32_000, seq_len=2048) - flops_per_token(cfg, 32_000) == 12 * 12 * 768 * 2048
    assert mfu(tokens_per_s=1e6, flops_per_tok=1e9, peak_tflops=2000.0) == pytest.approx(0.5)


def test_cli_prints_the_plan(capsys):
    assert main(["plan", "7b", "--gpu-hours", "1000", "--mfu", "0.5", "--price-per-gpu-hour", "3"]) == 0
    out = capsys.readouterr().out
    assert "preset           7b" in out and "1,000.0 at 50% MFU" in out and "$3,000" in out
    assert main(["plan", "3b"]) == 2
    assert "known: tiny, 125m, 1b, 7b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "tiny", "--gpu-hours", "1", "--tokens", "5"])
