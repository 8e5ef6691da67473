"""Stage 6, evaluate: perplexity, bits per byte, held-out arithmetic, and multiple-choice files for
every model of the run; the report card compares base → SFT → aligned.

`Config`, `VERSION` and `fingerprint` come from `config` (light, so planning a run stays fast);
`run` is imported from `stage` on first use."""
from typing import Any

from tasks.evaluate.config import VERSION, Config, fingerprint

__all__ = ["Config", "VERSION", "fingerprint", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # the stage imports its heavy dependencies: only when it is used
        from tasks.evaluate.stage import run
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
