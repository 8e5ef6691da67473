"""The evaluate stage's contract without its evaluation code: `Config`, `VERSION`, `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so this module imports no torch or transformers; `run` is in stage.py.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from core.sources import JSONL_SUFFIXES, fingerprint_sources, source_files
from core.stage import StageConfig

VERSION = 1


class Config(StageConfig):
    """What to evaluate and how much of it."""

    seq_len: int = Field(256, description="Tokens per perplexity window (non-overlapping windows); "
                                          "must not exceed the model's max positions.")
    max_eval_tokens: int = Field(262_144, description="Upper bound on val tokens scored for perplexity.")
    arith_problems: int = Field(100, description="Number of arithmetic test problems per model.")
    arith_seed: int = Field(0, description="Seed choosing which arithmetic test problems are asked.")
    max_new_tokens: int = Field(16, description="Greedy generation budget per arithmetic answer (tokens).")
    batch_size: int = Field(16, description="Sequences per forward pass / generation batch.")
    mc_tasks: tuple[str, ...] = Field((), description="Paths of multiple-choice JSONL files "
                                                      "({query, choices, gold} per line).")
    mc_max_items: int = Field(500, description="Items scored per multiple-choice file (the first N).")
    mc_delimiter: str = Field("\nAnswer: ", description="Text between a multiple-choice query and "
                                                        "each choice (llm-foundry's continuation_delimiter).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to run the models; "
                                                                       "auto picks cuda when available.")

    # "auto" resolves per machine, so hashing it would not record the device anyway; the device
    # used is written into results.json instead.
    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"device"})

    @field_validator("seq_len", "max_eval_tokens", "arith_problems", "max_new_tokens",
                     "batch_size", "mc_max_items")
    @classmethod
    def _positive(cls, v: int, info: Any) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("mc_tasks")
    @classmethod
    def _mc_files(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for path in v:
            source_files(path, JSONL_SUFFIXES)  # ValueError naming a missing or unsupported file
        return v


def fingerprint(config: Config) -> str:
    """Digest of the multiple-choice files' contents, so editing one triggers a re-run."""
    return fingerprint_sources(config.mc_tasks, JSONL_SUFFIXES)
