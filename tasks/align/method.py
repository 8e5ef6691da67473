"""What an alignment method is to the align stage: a settings section and a training function.

A method module (dpo.py, grpo.py, ppo.py) defines a settings class (a pydantic `StageConfig` with
`sources()`, the data it reads) and `train(settings, job) -> (trained model, stats)`, and exports
`METHOD = Method(...)`; `tasks/align/stage.py` lists it in `METHODS`. The stage then offers the
section `align.<name>` in its config, hashes only the chosen method's section, and exports
whatever model the method returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from core.stage import StageConfig
from model.lora import LoraSettings


@dataclass
class AlignJob:
    """What every method receives besides its settings."""

    model: torch.nn.Module  # the SFT model, float32, on the CPU
    tokenizer: Any  # with the chat template
    out_dir: Path  # the stage's work directory: checkpoints go under out_dir/checkpoints
    lora: LoraSettings | None  # train only LoRA adapters (methods that cannot, say so)


@dataclass(frozen=True)
class Method:
    settings: type[StageConfig]  # the `align.<name>` section; must have `sources() -> list[str]`
    train: Callable[[Any, AlignJob], tuple[torch.nn.Module, dict[str, Any]]]
    description: str  # one line, shown in the config's field description
