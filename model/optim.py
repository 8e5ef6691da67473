"""The training loop's optimizers: AdamW, or Muon for the hidden matrices with AdamW for the rest.

Muon (torch.optim.Muon: momentum, then Newton-Schulz orthogonalisation of each matrix's update) is
what nanochat and modded-nanogpt train their transformer blocks' matrices with. It is defined
for 2-D weights of hidden layers only: the embedding (tied to the output head here), norms and
biases stay on AdamW, as in both of those. `MuonAdamW` is one `torch.optim.Optimizer` over both,
so the loop's LR schedule, clipping, Accelerate's wrapping and checkpoints treat it as any other.
Muon's step is scaled as Moonshot's `match_rms_adamw` (0.2 * sqrt(max(A, B))), so one `lr` and one
`weight_decay` serve both halves.
"""
from __future__ import annotations

from typing import Any

import torch

from model.config import LoopConfig


def _groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, none on vectors (norm gains, biases)."""
    return [group for group in (
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}) if group["params"]]


class MuonAdamW(torch.optim.Optimizer):
    """Muon over `hidden_matrices`, AdamW over `others`, stepped together as one optimizer. Either
    side may be empty (LoRA trains adapter matrices only)."""

    def __init__(self, hidden_matrices: list[torch.nn.Parameter], others: list[torch.nn.Parameter],
                 cfg: LoopConfig):
        self.parts: dict[str, torch.optim.Optimizer] = {}
        if hidden_matrices:
            self.parts["muon"] = torch.optim.Muon(hidden_matrices, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                  momentum=cfg.muon_momentum, adjust_lr_fn="match_rms_adamw")
        if others:
            self.parts["adamw"] = torch.optim.AdamW(_groups(others, cfg.weight_decay), lr=cfg.lr,
                                                    betas=(cfg.beta1, cfg.beta2))
        # The parts' own group dicts, so the LR scheduler's writes reach them.
        super().__init__(self._parts_groups(), {})

    def _parts_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts.values() for group in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW takes no closure")
        for part in self.parts.values():
            part.step()

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.keys() != self.parts.keys():
            raise ValueError(f"optimizer state has parts {sorted(state_dict)}, expected {sorted(self.parts)}")
        for name, part in self.parts.items():
            part.load_state_dict(state_dict[name])
        self.param_groups = self._parts_groups()  # loading made new dicts


def make_optimizer(model: torch.nn.Module, cfg: LoopConfig) -> torch.optim.Optimizer:
    """`cfg.optimizer`: AdamW with weight decay on matrices only (fused when the parameters are on
    CUDA), or MuonAdamW with Muon on the hidden layers' matrices."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "muon":
        embeddings = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
                      if m is not None}
        hidden = [p for p in params if p.dim() == 2 and id(p) not in embeddings]
        return MuonAdamW(hidden, [p for p in params if not (p.dim() == 2 and id(p) not in embeddings)], cfg)
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(_groups(params, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=fused or None)
