"""The training loop's optimizers: AdamW, or Muon for the hidden matrices with AdamW for the rest.

Muon (momentum, then Newton-Schulz orthogonalisation of each matrix's update) is what nanochat
and modded-nanogpt train their transformer blocks' matrices with. It is defined for 2-D weights of
hidden layers only: the embedding (tied to the output head here), norms and biases stay on AdamW,
as in both of those. `MuonAdamW` is one `torch.optim.Optimizer` over both, with one state dict in
torch's standard form, so the loop's LR schedule, clipping and checkpoints (sharded or not) treat
it as any other. Muon's step is scaled as Moonshot's `match_rms_adamw` (0.2 * sqrt(max(A, B))), so
one `lr` and one `weight_decay` serve both halves.

`Muon` here is torch.optim.Muon's update with two differences: the orthogonalisation runs in the
precision the device multiplies fast (bf16 on GPUs; fp32 on CPUs, where bf16 matmuls without
native support are tens of times slower: docs/benchmarks.md), and a sharded (FSDP) matrix is
orthogonalised whole: gathered once, orthogonalised on every rank, each rank keeping its shard.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from gristmill.model.config import LoopConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# torch.optim.Muon's quintic Newton-Schulz coefficients and step count (Keller Jordan's Muon).
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores); fp32 elsewhere: a CPU without native bf16 runs bf16 matmuls
    far slower than fp32, and one with it gains little on matrices this size."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def orthogonalise(update: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz approximation of U V^T for update = U S V^T, computed in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)  # spectral norm at most 1
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(update.dtype)


def _orthogonalise_whole(update: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`orthogonalise` of the whole matrix, also when `update` is one rank's shard of it."""
    if not isinstance(update, DTensor):
        return orthogonalise(update, dtype)
    whole = orthogonalise(update.full_tensor(), dtype)
    # Every rank holds the same whole matrix: each keeps its own shard, with no communication.
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalised update, match_rms_adamw LR scale, decoupled weight decay."""

    def __init__(self, params: list[torch.nn.Parameter], *, lr: float, weight_decay: float, momentum: float,
                 ns_dtype: torch.dtype):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(param.grad, 1 - momentum)
                update = _orthogonalise_whole(param.grad.lerp(buf, momentum), self.ns_dtype)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-lr * 0.2 * math.sqrt(max(param.shape[:2])))


def _groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, none on vectors (norm gains, biases)."""
    return [group for group in (
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}) if group["params"]]


class MuonAdamW(torch.optim.Optimizer):
    """Muon over `hidden_matrices`, AdamW over `others`, stepped together as one optimizer. Either
    side may be empty (LoRA trains adapter matrices only). The parts share this optimizer's group
    dicts (so the LR scheduler's writes reach them) and its state dict (so `state_dict()` is
    torch's standard form, which torch's distributed checkpoint code reads)."""

    def __init__(self, hidden_matrices: list[torch.nn.Parameter], others: list[torch.nn.Parameter],
                 cfg: LoopConfig, ns_dtype: torch.dtype):
        self.parts: dict[str, torch.optim.Optimizer] = {}
        if hidden_matrices:
            self.parts["muon"] = Muon(hidden_matrices, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                      momentum=cfg.muon_momentum, ns_dtype=ns_dtype)
        if others:
            self.parts["adamw"] = torch.optim.AdamW(_groups(others, cfg.weight_decay), lr=cfg.lr,
                                                    betas=(cfg.beta1, cfg.beta2))
        super().__init__([group for part in self.parts.values() for group in part.param_groups], {})
        self._share_state()

    def _share_state(self) -> None:
        for part in self.parts.values():
            part.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW takes no closure")
        for part in self.parts.values():
            part.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Loading made new group dicts and a new state dict: hand them to the parts, in order.
        groups = iter(self.param_groups)
        for part in self.parts.values():
            part.param_groups = [next(groups) for _ in part.param_groups]
        self._share_state()


def make_optimizer(model: torch.nn.Module, cfg: LoopConfig) -> torch.optim.Optimizer:
    """`cfg.optimizer`: AdamW with weight decay on matrices only (fused when the parameters are on
    CUDA), or MuonAdamW with Muon on the hidden layers' matrices."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "muon":
        hf = cast("PreTrainedModel", model)  # a transformers model (or PEFT's, which forwards both methods)
        embeddings = {id(m.weight) for m in (hf.get_input_embeddings(), hf.get_output_embeddings())
                      if m is not None}
        hidden = [p for p in params if p.dim() == 2 and id(p) not in embeddings]
        device = params[0].device if params else torch.device("cpu")
        return MuonAdamW(hidden, [p for p in params if not (p.dim() == 2 and id(p) not in embeddings)], cfg,
                         newton_schulz_dtype(device))
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(_groups(params, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=fused or None)
