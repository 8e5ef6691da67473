"""Training throughput and model FLOPs utilisation (MFU), as the training loop logs them."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("gristmill.throughput")

# Dense bf16 tensor-core peaks (TFLOP/s, vendor datasheets) by the exact name CUDA reports: one
# family's cards differ (an H100 PCIe has 756, an NVL 835, an SXM 989), so no name is guessed from
# a part of another.
GPU_PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA B200": 2250.0,
    "NVIDIA L40S": 362.0,
}


def peak_tflops_of(name: str) -> float | None:
    """The dense bf16 peak of the GPU CUDA calls `name`, or None (with one warning) when unknown."""
    peak = GPU_PEAK_TFLOPS.get(name.strip())
    if peak is None:
        log.warning("no bf16 peak known for the GPU %r: mfu is not reported; set the stage's peak_tflops "
                    "(TFLOP/s of one device) to report it", name)
    return peak


def device_peak_tflops(configured: float | None, device: torch.device) -> float | None:
    """Peak TFLOP/s of one device for MFU: the configured value, else a known GPU's bf16 peak."""
    if configured is not None or device.type != "cuda":
        return configured
    return peak_tflops_of(torch.cuda.get_device_name(device))


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
        if self.flop_budget and self.flops_per_token:  # both known, or neither (see __init__)
            row["mfu"] = tokens_per_s * self.flops_per_token / self.flop_budget
        return row

    def report(self) -> dict[str, float]:
        row = self.with_mfu(self.tokens / max(self.seconds, 1e-9))
        self.tokens, self.seconds = 0, 0.0
        return row
