"""The evaluate stage's contract without its evaluation code: `Config`, `VERSION`, `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so this module imports no torch or transformers; `run` is in stage.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from gristmill.core.sources import JSONL_SUFFIXES, fingerprint_sources, source_files
from gristmill.core.stage import StageConfig
from gristmill.tasks.evaluate.formats import piqa_labels_path, task_name

VERSION = 3  # 3: llm-foundry files scored with their task's delimiter; MMLU with its subject line;
# val_bpb over the exact bytes of the scored tokens (it was the split's average bytes per token)
# 2: the benchmark engine (tasks, limit) replaced mc_tasks
COMPRESSION_PREFIX = "compression_"  # the stats of the compressor baselines: compression_xz_bpb...
# The models scored, in report column order: pretrain's, SFT's and align's; stats are "<label>_<metric>".
MODEL_LABELS = ("base", "sft", "aligned")


class Config(StageConfig):
    """What to evaluate and how much of it."""

    seq_len: int = Field(default=256, description="Tokens per perplexity window (non-overlapping windows); "
                                                  "must not exceed the model's max positions.")
    max_eval_tokens: int = Field(default=262_144, description="Upper bound on val tokens scored for perplexity.")
    compression_train_mb: float = Field(
        default=64.0, ge=0, description="Training text (MiB, from the start of the train split) the compressor "
                                        "baselines read before the val bytes; xz -9e's window is 64 MiB. 0: only "
                                        "the compressors alone.")
    arith_problems: int = Field(default=100, description="Number of arithmetic test problems per model.")
    arith_seed: int = Field(default=0, description="Seed choosing which arithmetic test problems are asked.")
    max_new_tokens: int = Field(default=16, description="Greedy generation budget per arithmetic answer (tokens).")
    batch_size: int = Field(default=16, description="Sequences per forward pass / generation batch.")
    tasks: tuple[str, ...] = Field(default=(), description="Benchmark JSONL files scored by the benchmark engine "
                                                           "(formats recognised from their fields: "
                                                           "docs/evaluation.md#formats).")
    delimiters: dict[str, str] = Field(default={}, description="Continuation delimiter (text between query and "
                                       "choice, llm-foundry's continuation_delimiter) by task name, for "
                                       "llm-foundry multiple-choice files; a file not named here uses its "
                                       "benchmark's (docs/evaluation.md#formats).")
    limit: int | None = Field(default=500, description="Items scored per benchmark file (the first N; None: all).")
    gsm8k_max_new_tokens: int = Field(default=256, description="Generation budget per GSM8K answer (tokens).")
    gsm8k_samples: int = Field(default=0, description="Sampled GSM8K answers per problem for pass@k (0: greedy only).")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="Where to run the models; "
                                                                               "auto picks cuda when available.")

    # "auto" resolves per machine, so hashing it would not record the device anyway; the device
    # used is written into results.json instead.
    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"device"})

    @field_validator("seq_len", "max_eval_tokens", "arith_problems", "max_new_tokens",
                     "batch_size", "gsm8k_max_new_tokens")
    @classmethod
    def _positive(cls, v: int, info: Any) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("limit")
    @classmethod
    def _limit(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"limit must be >= 1 or None, got {v}")
        return v

    @field_validator("gsm8k_samples")
    @classmethod
    def _samples(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"gsm8k_samples must be >= 0, got {v}")
        return v

    @field_validator("tasks")
    @classmethod
    def _task_files(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for path in v:
            if len(source_files(path, JSONL_SUFFIXES)) != 1:  # ValueError naming a missing file
                raise ValueError(f"tasks: {path} is not one benchmark file")
        names = [task_name(Path(path)) for path in v]  # results are kept per task name
        if len(set(names)) != len(names):
            raise ValueError(f"tasks: two files share a task name: {sorted({n for n in names if names.count(n) > 1})}")
        return v

    @model_validator(mode="after")
    def _delimiters_name_tasks(self) -> Config:
        unknown = sorted(set(self.delimiters) - {task_name(Path(path)) for path in self.tasks})
        if unknown:
            raise ValueError(f"delimiters: {unknown} name no file of tasks")
        return self


def fingerprint(config: Config) -> str:
    """Digest of the benchmark files' contents (PIQA's labels file beside it included), so
    editing one triggers a re-run."""
    labels = [str(piqa_labels_path(Path(p))) for p in config.tasks if piqa_labels_path(Path(p)).is_file()]
    return fingerprint_sources([*config.tasks, *labels])
