"""Stage 3, pretrain: next-token prediction from scratch on the token shards, on the shared
training loop of `model.loop` (Accelerate: one CPU to many GPU processes).

`Config`, `VERSION` and `fingerprint` come from `config` (light, so planning a run stays fast);
`run` is imported from `stage` on first use."""
from typing import Any

from tasks.pretrain.config import VERSION, Config, fingerprint

__all__ = ["Config", "VERSION", "fingerprint", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # the stage imports its heavy dependencies: only when it is used
        from tasks.pretrain.stage import run
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
