"""How the training loop spreads a model over its data-parallel processes, and gathers it back.

- Replicated (the default): every process holds the whole model; Accelerate wraps it in DDP.
- Sharded (`fsdp: true`): FSDP2's `fully_shard` on each decoder block, then on the root, applied
  here by the loop itself, as torchtitan does. Not through Accelerate's FSDP plugin: on a CPU
  `Accelerator(cpu=True)` silently replaces it with DDP, so tests there would never run the path
  the GPUs run. This code is the same on CPU/gloo and CUDA/NCCL. Parameters stay fp32 and sharded;
  under bf16 the blocks compute in bf16 and gradients are reduced in fp32.
- Compiled (`compile: true`): each decoder block is compiled in place after sharding, so FSDP's
  hooks stay outside the graphs and one graph serves every block (parameters are graph inputs).

Checkpoints and exports use full (gathered) state dicts: every rank takes part in the gather, rank
0 writes; loading reads on rank 0 and broadcasts. So a checkpoint does not depend on the world
size, nor on whether the model was sharded, and no node but rank 0's needs to see its files.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0's CPU only


def launched_world_size() -> int:
    """Processes of this data-parallel launch, as every launcher (torchrun, `accelerate launch`,
    Ray Train) announces it before the process group exists; 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def leave_process_group() -> None:
    """Leave the process group before a rank exits: ranks that exit without it may be aborted
    after their work is done (SIGABRT in gloo's teardown), and their launcher then fails."""
    if distributed():
        dist.destroy_process_group()


def is_rank0() -> bool:
    return not distributed() or dist.get_rank() == 0


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (a Llama's `model.layers`): the units sharded and compiled."""
    layers = cast("PreTrainedModel", model).get_decoder().layers  # a transformers model (or PEFT's around one)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}'s decoder has no list of layers to shard")
    return list(layers)


def shard(model: torch.nn.Module, precision: str) -> None:
    """FSDP2 in place: each decoder block is one unit (its weights gathered just before its
    forward and freed after), the root holds the rest (embedding, final norm, head). Under bf16,
    blocks compute in bf16 while gradients are reduced and kept in fp32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None,
                                  reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def compile_blocks(model: torch.nn.Module) -> None:
    """Compile each decoder block in place (parameter names, and so checkpoints, stay the eager
    model's); after `shard`, so the graphs hold no FSDP communication."""
    for block in decoder_blocks(model):
        block.compile()


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most `max_norm`; returns the norm before.
    Sharded gradients (DTensors) give a norm over every rank's shard, so all ranks agree."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
    return float(total)


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that are another name of an earlier parameter (a tied output head)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU ({} on other ranks), each tied tensor once.
    Collective: every rank must call it."""
    state = get_model_state_dict(model, options=GATHER)
    for alias in _aliases(model):
        state.pop(alias, None)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: a {type(value).__name__} in the model's state, not a tensor")
        tensors[name] = value.contiguous()
    return tensors


def with_aliases(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full_model_state`'s output with each tied tensor under all of `model`'s names for it."""
    return {**state, **{alias: state[name] for alias, name in _aliases(model).items()}}


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `full_model_state`'s output, given on rank 0 (other ranks pass {}), into every rank's
    model, sharded or not. Collective."""
    # torch's parameter is dict[str, ValueType], invariant, which a dict of tensors is not
    whole: dict[str, Any] = with_aliases(model, state) if is_rank0() else state
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=distributed()))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter name, whole, on rank 0 ({} elsewhere). Collective.
    Call it only once the optimizer has stepped: torch creates missing state with a step."""
    return get_optimizer_state_dict(model, optimizer, options=GATHER)


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load `full_optimizer_state`'s output (on rank 0; {} elsewhere) into every rank. Collective."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=distributed()))
