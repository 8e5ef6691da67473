"""Stage 5, align: tune the SFT model with a registered method — DPO (preference pairs), GRPO
(verifiable rewards) or PPO (a reward model, then RLHF) — optionally with LoRA.

Modules: `config` (each method's config section, the stage's Config and the `METHODS` registry),
`stage` (the dispatcher), `method` (what a method is), `trl_common` (TRL plumbing shared by DPO,
GRPO and the reward model), one module per method (`dpo`, `grpo`, `ppo`), `reward_model`,
`preferences` (preference data) and `rewards` (verifiable rewards). Adding a method = its section
in `config.Config` + one new module + one entry in `config.METHODS`.

`config` holds the stage's `Config`, `VERSION` and `fingerprint` (no torch or TRL, so planning a run
stays fast); `stage` its `run`, imported only when the stage computes. The stage's entry in
flows/stages.py names both."""
