"""The SFT stage's contract without its training code: `Config`, `VERSION`, `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so this module imports no torch; `run` is in stage.py.
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from gristmill.core.launch import LaunchConfig
from gristmill.core.sources import JSONL_SUFFIXES, fingerprint_sources
from gristmill.model.config import LoopConfig, LoraConfig

VERSION = 5  # 3: pretraining text mixed into the batches (pretrain_mix); 4: logits only at scored
            # positions (the same loss, summed in another order: weights differ in the last bits);
            # 5: the loss is the global batch's token mean, whatever the processes and micro-batches


class Config(LoopConfig):
    """Supervised fine-tuning: data sources, sequence limits, held-out share, packing, LoRA, the
    share of pretraining text mixed in, the loop knobs and the launch."""

    unhashed_fields: ClassVar[frozenset[str]] = LoopConfig.unhashed_fields | {"launch"}

    data: list[str] = Field(default=["demo:arithmetic"], min_length=1,
                            description="Conversation sources: 'demo:arithmetic' or JSONL(.gz) paths "
                                        "(messages, prompt/response, self-instruct, or OpenAssistant "
                                        "message trees; detected per file).")
    max_examples: int | None = Field(default=None, gt=0, description="At most this many conversations per source "
                                                                     "(None: all; the demo then gives 500).")
    max_seq_len: int = Field(default=256, gt=1, description=(
        "Rendered conversations longer than this many tokens are truncated (and counted); with packing, "
        "the row length."))
    heldout_fraction: float = Field(default=0.1, ge=0, lt=1, description="Share of conversations held out to "
                                                                         "measure assistant-token loss before/after.")
    packing: bool = Field(default=False, description="Concatenate examples into rows of up to max_seq_len tokens "
                                                     "(best fit decreasing); each keeps its own positions and "
                                                     "attends only to itself. batch_size then counts rows.")
    pretrain_mix: float = Field(
        default=0.25, ge=0, lt=1,
        description="Weight of plain next-token loss on pretraining text (windows of the tokenize stage's "
                    "train tokens) in every step's loss: (1 - pretrain_mix) * assistant-token loss + "
                    "pretrain_mix * text loss, so the model keeps its language while it learns the "
                    "conversations (tiny preset: validation perplexity 282 -> 187 with 0.25, -> 1.3M with "
                    "conversations alone; docs/benchmarks.md#sft-keeps-the-models-language). 0: "
                    "conversations only, and no tokenize artifact needed.")
    pretrain_windows: int = Field(
        default=2, gt=0, description="Pretraining windows of max_seq_len tokens per step when pretrain_mix > 0 "
                                     "(a multiple of grad_accum_steps), in a seeded order over the train tokens.")
    lora: LoraConfig | None = Field(default=None, description="Train LoRA adapters on a frozen base model "
                                                              "(None: full fine-tuning). The export merges them.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description=(
        "The processes it trains in: inline, or data-parallel under Accelerate (operational)."))

    @model_validator(mode="after")
    def _windows_split_evenly(self) -> Config:
        # The loop splits every tensor of a batch into grad_accum_steps micro-batches; fewer windows
        # than micro-batches would leave some micro-batches without their share of text.
        accum = (self.with_seq_len(self.max_seq_len, self.launch.world_size) if self.packing
                 else self).grad_accum_steps
        if self.pretrain_mix > 0 and self.pretrain_windows % accum:
            raise ValueError(f"pretrain_windows ({self.pretrain_windows}) must be a multiple of the "
                             f"gradient accumulation steps ({accum})")
        return self

    @model_validator(mode="after")
    def _lora_unsharded(self) -> Config:
        if self.fsdp and self.lora is not None:
            raise ValueError("fsdp: true with lora: adapters train on an unsharded base model; set fsdp: false "
                             "or remove lora")
        return self


def fingerprint(config: Config) -> str:
    """Digest of the data files the config points at, so an edited file triggers a re-run."""
    return fingerprint_sources(config.data, JSONL_SUFFIXES)
