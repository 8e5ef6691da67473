"""Training throughput and model FLOPs utilisation (MFU), as the training loop logs them."""
from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (TFLOP/s) of GPUs the MFU is reported for without `peak_tflops`.
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def device_peak_tflops(configured: float | None, device: torch.device) -> float | None:
    """Peak TFLOP/s of one device for MFU: the configured value, else a known GPU's bf16 peak."""
    if configured is not None or device.type != "cuda":
        return configured
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_TFLOPS.items() if key in name), None)


class Throughput:
    """Tokens per second of training steps (eval and checkpoint time excluded) since the last
    report, and the MFU they amount to."""

    def __init__(self, flops_per_token: float | None, peak_tflops: float | None, processes: int):
        self.flop_budget = peak_tflops * 1e12 * processes if flops_per_token and peak_tflops else None
        self.flops_per_token = flops_per_token
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds

    def with_mfu(self, tokens_per_s: float) -> dict[str, float]:
        """{"tokens_per_s": ..., "mfu": ...}, the latter only when it is known."""
        row = {"tokens_per_s": tokens_per_s}
        if self.flop_budget:
            row["mfu"] = tokens_per_s * self.flops_per_token / self.flop_budget
        return row

    def report(self) -> dict[str, float]:
        row = self.with_mfu(self.tokens / max(self.seconds, 1e-9))
        self.tokens, self.seconds = 0, 0.0
        return row
