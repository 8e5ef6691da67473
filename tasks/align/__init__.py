"""Stage 5, align: tune the SFT model with a registered method — DPO (preference pairs), GRPO
(verifiable rewards) or PPO (a reward model, then RLHF) — optionally with LoRA.

Modules: `stage` (the dispatcher and its `METHODS` registry), `method` (what a method is),
`trl_common` (TRL plumbing shared by DPO, GRPO and the reward model), one module per method
(`dpo`, `grpo`, `ppo`), `reward_model`, `preferences` (preference data) and `rewards`
(verifiable rewards). Adding a method = one new module + one entry in `stage.METHODS`.
"""
from tasks.align.stage import VERSION, Config, fingerprint, run

__all__ = ["Config", "VERSION", "fingerprint", "run"]
