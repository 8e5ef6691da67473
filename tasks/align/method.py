"""What an alignment method is to the align stage: a settings section and a training function.

A method has a settings class in settings.py (a pydantic `StageConfig` with `sources()`, the data
it reads) and a module (dpo.py, grpo.py, ppo.py) with `train(settings, job) -> (trained model,
stats)`; `tasks/align/config.py` lists it in `METHODS` by the settings class and the module's name.
The stage then offers the section `align.<name>` in its config, hashes only the chosen method's
section, imports the module when the method runs, and exports whatever model `train` returns.
Registering the module by name keeps torch and TRL out of planning a run (the config needs only
the settings classes).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from core.stage import StageConfig
from model.settings import LoraSettings

if TYPE_CHECKING:  # annotations only: importing this module must not import torch
    import torch


@dataclass
class AlignJob:
    """What every method receives besides its settings."""

    model: torch.nn.Module  # the SFT model, float32, on the CPU
    tokenizer: Any  # with the chat template
    out_dir: Path  # the stage's work directory: checkpoints go under out_dir/checkpoints
    lora: LoraSettings | None  # train only LoRA adapters (methods that cannot, say so)


TrainFn = Callable[[Any, AlignJob], "tuple[torch.nn.Module, dict[str, Any]]"]


@dataclass(frozen=True)
class Method:
    settings: type[StageConfig]  # the `align.<name>` section; must have `sources() -> list[str]`
    # The training function, or the dotted name of the module whose `train` it is, imported only
    # when the method runs (tasks/align/stage.py).
    train: str | TrainFn
    description: str  # one line, shown in the config's field description
