"""The data-parallel processes PPO (model/ppo.py) trains in, and what they exchange: sums and means of
metrics, averaged gradients, barriers. One process (`ONE_PROCESS`) exchanges nothing."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ranks:
    """The data-parallel processes PPO trains in. Each rolls out its share of a step's prompts;
    advantages are whitened, gradients averaged and metrics reported over all of them, so every
    process takes the same optimizer step and holds the same weights."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"  # of the tensors exchanged: the policy's (NCCL needs CUDA)

    @classmethod
    def of_launch(cls, device: torch.device) -> Ranks:
        """This process's place in the launch that started it (Accelerate's state joins the
        process group the launcher set up); one process when it was not launched."""
        from accelerate import PartialState

        state = PartialState()
        return cls(state.process_index, state.num_processes, str(device))

    @classmethod
    def of_process_group(cls) -> Ranks:
        """This process's place in the process group it joined, whoever launched it; one process
        when it joined none."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return ONE_PROCESS
        return cls(dist.get_rank(), dist.get_world_size(), "cuda" if dist.get_backend() == "nccl" else "cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def total(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each (scalar) value summed over the processes."""
        if self.world == 1:
            return values
        stacked = torch.stack([v.detach().float().to(self.device) for v in values])
        torch.distributed.all_reduce(stacked)
        return tuple(stacked)

    def average(self, row: dict[str, float]) -> dict[str, float]:
        """A row of metrics, each the mean of the processes' values."""
        if self.world == 1:
            return row
        totals = self.total(*(torch.tensor(float(v)) for v in row.values()))
        return {k: t.item() / self.world for k, t in zip(row, totals)}

    def average_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        for param in params:
            if param.grad is not None:
                torch.distributed.all_reduce(param.grad)
                param.grad /= self.world

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


ONE_PROCESS = Ranks()
