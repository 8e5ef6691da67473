"""Stage 2, tokenize: train a byte-level BPE tokenizer (HF `tokenizers`) with the chat template's
special tokens, and encode the collected documents into uint16/uint32 token shards.

`Config`, `VERSION` and `fingerprint` come from `config` (light, so planning a run stays fast);
`run` is imported from `stage` on first use."""
from typing import Any

from tasks.tokenize.config import VERSION, Config, fingerprint

__all__ = ["Config", "VERSION", "fingerprint", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # the stage imports its heavy dependencies: only when it is used
        from tasks.tokenize.stage import run
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
