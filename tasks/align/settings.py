"""The settings section of every alignment method, importable without torch or TRL.

`config.METHODS` builds the stage's Config from these (one section per method, `align.<name>`), so
planning a run validates them without importing the trainers; each method's module (dpo.py,
grpo.py, ppo.py, reward_model.py) imports its settings from here. A method's settings have
`sources()`, the data files it reads (the stage's fingerprint digests them).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from core.settings import TrainSettings
from core.stage import StageConfig
from model.settings import PPOSettings


class TrlSettings(TrainSettings):
    """The shared training settings plus the sequence limit of a TRL-trained method."""

    max_seq_len: int = Field(256, ge=8, description=(
        "Most tokens of a prompt+response sequence (what happens to longer ones, cut or dropped, "
        "is counted in the stage's stats)."))


class DPOSettings(TrlSettings):
    """DPO on preference pairs; prompt+reply sequences longer than max_seq_len are cut at the end
    (counted), pairs whose prompt alone fills it are dropped."""

    data: list[str] = Field(["demo:arithmetic"], description=(
        "Preference sources: 'demo:arithmetic' or JSONL(.gz) files, folders or globs in "
        "prompt/chosen/rejected, hh-rlhf or AlpacaEval-annotation format (tasks/align/preferences.py)."))
    max_pairs: int | None = Field(None, ge=1, description=(
        "At most this many usable pairs from each source (None: all; demo: 256)."))
    beta: float = Field(0.1, gt=0, description="DPO beta: strength of the pull towards the reference model.")
    sft_weight: float = Field(0.0, ge=0, description=(
        "Weight of an added NLL loss on the chosen responses (RPO). DPO alone can lower a rejected "
        "reply by garbling the tokens after the point where it departs from the chosen one; this "
        "keeps the chosen replies likely. 0: plain DPO."))
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description=(
        "Share of the pairs held out of training to measure preference accuracy and margin."))

    @field_validator("data")
    @classmethod
    def _data_not_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("data must name at least one preference source")
        return value

    def sources(self) -> list[str]:
        return self.data


class GRPOSettings(TrlSettings):
    """Group relative policy optimisation with verifiable rewards (tasks/align/rewards.py);
    prompts that leave no room for max_completion_len tokens within max_seq_len are dropped."""

    prompts: list[str] = Field(["demo:arithmetic"], min_length=1, description=(
        "Prompt sources with reference answers: 'demo:arithmetic' or JSONL(.gz) math word problems "
        "(SVAMP context/answer, GSM8K question/answer, question|prompt + answer; see tasks/align/rewards.py)."))
    max_prompts: int | None = Field(None, ge=1, description="At most this many training prompts (None: all).")
    heldout_prompts: int = Field(64, ge=1, description=(
        "Held-out prompts (those hashing into the test bucket, core.arithmetic.split_of) whose "
        "greedy accuracy is measured before and after training."))
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt: the group whose "
                                                      "mean reward is each completion's baseline.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the training completions.")
    max_completion_len: int = Field(16, ge=1, description="Tokens generated per completion at most.")
    kl_beta: float = Field(0.0, ge=0, description=(
        "Weight of the per-token KL penalty to the reference (SFT) model; 0 skips the reference."))
    format_weight: float = Field(0.1, ge=0, description=(
        "Weight of the format reward (ends with the answer sentence) beside the numeric match (weight 1)."))
    scale_rewards: Literal["group", "batch", "none"] = Field("batch", description=(
        "Advantage = reward - group mean, divided by the std of its group, of the whole batch, or "
        "nothing. 'group' blows a small format difference within an all-wrong group up to the "
        "size of a right answer, rewarding wrong answers; 'batch' keeps the rewards' proportions."))

    def sources(self) -> list[str]:
        return self.prompts


class RewardModelSettings(TrlSettings):
    """How the reward model is trained (the shared training settings; batch_size counts pairs).
    Pairs with a side longer than max_seq_len are dropped (counted as dropped_rm_too_long)."""

    center_rewards_coef: float = Field(0.01, ge=0, description=(
        "Weight of the mean squared reward added to the loss, which keeps scores centred on 0 "
        "(Eisenstein et al. 2023) so PPO's kl_coef means the same across runs; 0 disables."))


class PPOMethodSettings(StageConfig):
    """RLHF: a reward model trained on preference pairs, then PPO against it. Each of the two
    trainings has its own section of the shared training settings (`reward_model`, `policy`);
    the held-out split is drawn with reward_model.seed."""

    data: list[str] = Field(["demo:arithmetic"], min_length=1, description=(
        "Preference sources for the reward model (formats as dpo.data); their prompts are PPO's prompts."))
    max_pairs: int | None = Field(None, ge=1, description="At most this many usable pairs per source.")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description=(
        "Share of the pairs held out: reward-model accuracy and the policy's held-out score."))
    reward_model: RewardModelSettings = Field(default_factory=RewardModelSettings,
                                              description="Reward-model training (Bradley-Terry).")
    policy: PPOSettings = Field(default_factory=PPOSettings, description="PPO rollouts and updates.")

    def sources(self) -> list[str]:
        return self.data
