"""Stage 4, SFT: chat-template fine-tuning with the loss on assistant tokens only, optional LoRA
and packing. `conversations` reads the supported conversation formats.

`Config`, `VERSION` and `fingerprint` come from `config` (light, so planning a run stays fast);
`run` is imported from `stage` on first use."""
from typing import Any

from tasks.sft.config import VERSION, Config, fingerprint

__all__ = ["Config", "VERSION", "fingerprint", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # the stage imports its heavy dependencies: only when it is used
        from tasks.sft.stage import run
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
