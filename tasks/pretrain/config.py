"""The pretrain stage's contract without its training code: `Config`, `VERSION`, `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so this module imports no torch; `run` is in stage.py.
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from gristmill.core.launch import LaunchConfig
from gristmill.model.config import LoopConfig, ModelConfig

VERSION = 3  # 3: Muon orthogonalises in the device's fast precision; micro-batches per process (model/)


class Config(LoopConfig):
    """Pretraining: model shape, sequence length, the shared optimisation knobs and the launch."""

    unhashed_fields: ClassVar[frozenset[str]] = LoopConfig.unhashed_fields | {"launch"}

    model: ModelConfig = Field(default_factory=ModelConfig, description="Shape of the model trained from scratch.")
    seq_len: int = Field(default=256, gt=0, description="Tokens per training sequence (each window holds seq_len + 1 "
                                                        "tokens: inputs and their next-token targets).")
    val_windows: int = Field(default=32, gt=0, description="Number of fixed, evenly spaced val.bin windows the "
                                                           "validation loss is measured on.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description=(
        "The processes it trains in: inline, or data-parallel under Accelerate (operational)."))

    @model_validator(mode="after")
    def _check_seq_len(self) -> Config:
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        self.with_seq_len(self.seq_len, self.launch.world_size)  # whole micro-batches on every process
        return self


def fingerprint(config: Config) -> None:
    """Pretraining reads only its upstream token shards: no external data to digest."""
    return None
