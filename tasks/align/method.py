"""What an alignment method is to the align stage: a config section and a training function.

A method has a config section in config.py (a pydantic `StageConfig` with `sources()`, the data it
reads; the field `align.<name>` of the stage's Config) and a module (dpo.py, grpo.py, ppo.py) with
`train(config, job) -> (trained model, stats)`, which `config.METHODS` names. The stage hashes only
the chosen method's section, imports the module when the method runs, and exports whatever model
`train` returns. Registering the module by name keeps torch and TRL out of planning a run (the
config needs only the section classes).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gristmill.model.config import LoraConfig

if TYPE_CHECKING:  # annotations only: importing this module must not import torch
    import torch
    from transformers import PreTrainedModel

    from gristmill.model.checkpoint import StoreMapping


@dataclass(kw_only=True)
class AlignJob:
    """What every method receives besides its config section."""

    model: PreTrainedModel  # the SFT model, float32, on the CPU
    tokenizer: Any  # with the chat template
    out_dir: Path  # the stage's work directory: checkpoints go under out_dir/checkpoints
    store_mapping: StoreMapping | None  # with a work directory, its checkpoints' place (model/checkpoint.py)
    lora: LoraConfig | None  # train only LoRA adapters (methods that cannot, say so)


TrainFn = Callable[[Any, AlignJob], "tuple[torch.nn.Module, dict[str, Any]]"]
