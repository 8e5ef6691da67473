"""Stage 5, align: tune the SFT model with a registered method — DPO (preference pairs), GRPO
(verifiable rewards) or PPO (a reward model, then RLHF) — optionally with LoRA.

Modules: `config` (the `METHODS` registry and the stage's Config), `settings` (each method's
settings section), `stage` (the dispatcher), `method` (what a method is), `trl_common` (TRL plumbing
shared by DPO, GRPO and the reward model), one module per method (`dpo`, `grpo`, `ppo`),
`reward_model`, `preferences` (preference data) and `rewards` (verifiable rewards). Adding a
method = its settings class + one new module + one entry in `config.METHODS`.

`Config`, `VERSION` and `fingerprint` come from `config` (no torch or TRL, so planning a run stays
fast); `run` is imported from `stage` on first use."""
from typing import Any

from tasks.align.config import VERSION, Config, fingerprint

__all__ = ["Config", "VERSION", "fingerprint", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # the stage imports its heavy dependencies: only when it is used
        from tasks.align.stage import run
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
