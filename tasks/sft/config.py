"""The SFT stage's contract without its training code: `Config`, `VERSION`, `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so this module imports no torch; `run` is in stage.py.
"""
from __future__ import annotations

from pydantic import Field

from core.sources import JSONL_SUFFIXES, fingerprint_sources
from model.settings import LoopConfig, LoraSettings

VERSION = 2


class Config(LoopConfig):
    """Supervised fine-tuning: data sources, sequence limits, held-out share, packing, LoRA, and the
    loop knobs."""

    data: list[str] = Field(["demo:arithmetic"], min_length=1,
                            description="Conversation sources: 'demo:arithmetic' or JSONL(.gz) paths "
                                        "(messages, prompt/response, self-instruct, or OpenAssistant "
                                        "message trees; detected per file).")
    max_examples: int | None = Field(None, gt=0, description="At most this many conversations per source "
                                                             "(None: all; the demo then gives 500).")
    max_seq_len: int = Field(256, gt=1, description="Rendered conversations longer than this many tokens "
                                                    "are truncated (and counted); with packing, the row length.")
    heldout_fraction: float = Field(0.1, ge=0, lt=1, description="Share of conversations held out to "
                                                                 "measure assistant-token loss before/after.")
    packing: bool = Field(False, description="Concatenate examples into rows of up to max_seq_len tokens "
                                             "(best fit decreasing); each keeps its own positions and "
                                             "attends only to itself. batch_size then counts rows.")
    lora: LoraSettings | None = Field(None, description="Train LoRA adapters on a frozen base model "
                                                        "(None: full fine-tuning). The export merges them.")


def fingerprint(config: Config) -> str:
    """Digest of the data files the config points at, so an edited file triggers a re-run."""
    return fingerprint_sources(config.data, JSONL_SUFFIXES)
