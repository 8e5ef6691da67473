"""The tokenize stage's contract without its encoding code: `Config`, `VERSION`, `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so this module imports no tokenizers or transformers; `run` is in stage.py.
"""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from gristmill.core.chat import SPECIAL_TOKENS
from gristmill.core.sources import fingerprint_sources
from gristmill.core.stage import StageConfig

VERSION = 2


class Config(StageConfig):
    """Tokenizer training and corpus encoding."""

    vocab_size: int = Field(default=4096, description="Target BPE vocabulary size, special tokens and the "
                                                      "256 byte symbols included (may end smaller on a tiny corpus).")
    min_frequency: int = Field(default=2, description="Minimum pair count for a BPE merge.")
    max_digits_per_token: int = Field(default=1, description="Longest run of digits one pre-token may hold (1-3). "
                                                             "1 gives every number a digit-by-digit spelling, which "
                                                             "small models learn arithmetic from far more easily; "
                                                             "3 is GPT-4's choice and compresses numbers better.")
    max_train_bytes: int = Field(default=50_000_000, description=(
        "UTF-8 bytes of train-split text (first documents in input order) used to train the tokenizer."))
    val_fraction: float = Field(default=0.05, description="Share of documents held out for validation, chosen "
                                                            "by a hash of the document id.")
    reference_vocab: str | None = Field(default=None, description="A tiktoken rank file (e.g. GPT-2's "
                                                                  "gpt2.tiktoken) whose bytes per token on the val "
                                                                  "text are reported next to ours; None skips it.")
    encode_batch_docs: int = Field(default=1000, description="Documents per encode_batch call (memory knob; "
                                                              "does not change outputs).")

    num_workers: int = Field(default=2, ge=1, description="Parallel workers (Ray actors) encoding input shards; "
                                                         "output is identical for any count (not hashed).")
    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"encode_batch_docs", "num_workers"})

    @field_validator("vocab_size")
    @classmethod
    def _vocab(cls, v: int) -> int:
        if not 256 + len(SPECIAL_TOKENS) < v <= 2**32:
            raise ValueError(f"vocab_size must exceed {256 + len(SPECIAL_TOKENS)} "
                             f"(bytes + special tokens), got {v}")
        return v

    @field_validator("max_digits_per_token")
    @classmethod
    def _digits(cls, v: int) -> int:
        if not 1 <= v <= 3:
            raise ValueError(f"max_digits_per_token must be 1, 2 or 3, got {v}")
        return v

    @field_validator("min_frequency", "max_train_bytes", "encode_batch_docs")
    @classmethod
    def _positive(cls, v: int, info: Any) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("val_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 < v < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {v}")
        return v


def fingerprint(config: Config) -> str | None:
    """Digest of the reference rank file's content (the only external input the config names)."""
    return None if config.reference_vocab is None else fingerprint_sources([config.reference_vocab])
