"""Compute planning: Chinchilla-optimal tokens, training FLOPs, GPU-hours and cost for a preset.

Rules of thumb, not measurements: compute-optimal data is about 20 tokens per parameter
(Hoffmann et al. 2022); training costs about 6 FLOPs per parameter per token (forward 2, backward
4), plus the attention score/value matmuls, 12 * layers * hidden * seq_len FLOPs per token (PaLM,
appendix B). Wall time = FLOPs / (peak FLOP/s * MFU).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from gristmill.model.presets import PLAN_VOCAB_SIZE, ModelConfig, config_params

CHINCHILLA_TOKENS_PER_PARAM = 20.0
H100_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM, dense bf16 tensor-core peak


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward): 6 * params, plus the attention term when a
    sequence length is given (0 for `seq_len=None`)."""
    attention = 12 * cfg.num_layers * cfg.hidden_size * seq_len if seq_len else 0
    return 6.0 * config_params(cfg, vocab_size) + attention


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s as a fraction of the hardware peak."""
    return tokens_per_s * flops_per_tok / (peak_tflops * 1e12)


@dataclass(frozen=True, kw_only=True)
class Plan:
    params: int
    tokens: float  # training tokens
    chinchilla_tokens: float  # compute-optimal tokens for this size
    flops: float  # 6 * params * tokens
    gpu_hours: float
    cost: float  # gpu_hours * price_per_gpu_hour
    mfu: float
    peak_tflops: float
    price_per_gpu_hour: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def plan(cfg: ModelConfig, *, vocab_size: int = PLAN_VOCAB_SIZE, tokens: float | None = None,
         gpu_hours: float | None = None, price_per_gpu_hour: float = 2.5, mfu: float = 0.4,
         peak_tflops: float = H100_BF16_DENSE_TFLOPS) -> Plan:
    """The budget of training `cfg`. Give at most one of `tokens` (a data budget) or `gpu_hours`
    (a compute budget, converted to the tokens it buys); neither means Chinchilla-optimal tokens."""
    if tokens is not None and gpu_hours is not None:
        raise ValueError("give tokens or gpu_hours, not both")
    for name, value in (("tokens", tokens), ("gpu_hours", gpu_hours), ("peak_tflops", peak_tflops)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if price_per_gpu_hour < 0:
        raise ValueError(f"price_per_gpu_hour must be >= 0, got {price_per_gpu_hour}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    params = config_params(cfg, vocab_size)
    flop_per_s = peak_tflops * 1e12 * mfu
    chinchilla = CHINCHILLA_TOKENS_PER_PARAM * params
    if gpu_hours is not None:
        tokens = gpu_hours * 3600 * flop_per_s / (6.0 * params)
    tokens = chinchilla if tokens is None else float(tokens)
    flops = 6.0 * params * tokens
    hours = flops / flop_per_s / 3600
    return Plan(params=params, tokens=tokens, chinchilla_tokens=chinchilla, flops=flops, gpu_hours=hours,
                cost=hours * price_per_gpu_hour, mfu=mfu, peak_tflops=peak_tflops,
                price_per_gpu_hour=price_per_gpu_hour)


def format_plan(name: str, p: Plan) -> str:
    """A human-readable summary of a plan."""
    return "\n".join([
        f"preset           {name}",
        f"parameters       {p.params:,} ({p.params / 1e6:,.1f}M)",
        f"chinchilla       {p.chinchilla_tokens:,.0f} tokens ({CHINCHILLA_TOKENS_PER_PARAM:g} per parameter)",
        f"tokens           {p.tokens:,.0f} ({p.tokens / p.params:.1f} per parameter)",
        f"flops            {p.flops:.3e} (6 * N * D)",
        f"gpu-hours        {p.gpu_hours:,.1f} at {p.mfu:.0%} MFU of {p.peak_tflops:g} TFLOP/s",
        f"cost             ${p.cost:,.0f} at ${p.price_per_gpu_hour:g} per GPU-hour",
    ])
