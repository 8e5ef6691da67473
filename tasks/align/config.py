"""The align stage's contract without its training code: each method's config section, the stage's
`Config`, the `METHODS` registry, `VERSION` and `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so nothing here imports torch or TRL: the registry names the module of each method's `train`,
which the stage imports only when the method runs (stage.py). A method's section has `sources()`,
the data files it reads (the stage's fingerprint digests them).

Adding a method: its section class here and a field of the same name in `Config` (with the name
in `method`'s choices), a module with `train(config, job)` (see method.py), and its entry in
`METHODS`; tests/tasks/align/test_align.py checks that the registry and the fields agree.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Protocol, get_args

from pydantic import Field, field_validator

from gristmill.core.launch import LaunchConfig
from gristmill.core.sources import JSONL_SUFFIXES, fingerprint_sources
from gristmill.core.stage import StageConfig
from gristmill.core.train_config import TrainConfig
from gristmill.model.config import LoraConfig, PPOConfig
from gristmill.tasks.align.method import TrainFn

VERSION = 3  # 3: one config section per method, shared training config (core.train_config)


class MethodSection(Protocol):
    """What every method's config section provides, besides its own settings."""

    def sources(self) -> list[str]:
        """The data sources it reads (core/sources.py)."""
        ...


class TrlConfig(TrainConfig):
    """The shared training config plus the sequence limit of a TRL-trained method."""

    max_seq_len: int = Field(default=256, ge=8, description=(
        "Most tokens of a prompt+response sequence (what happens to longer ones, cut or dropped, "
        "is counted in the stage's stats)."))


class DPOConfig(TrlConfig):
    """DPO on preference pairs; prompt+reply sequences longer than max_seq_len are cut at the end
    (counted), pairs whose prompt alone fills it are dropped."""

    data: list[str] = Field(default=["demo:arithmetic"], description=(
        "Preference sources: 'demo:arithmetic' or JSONL(.gz) files, folders or globs in "
        "prompt/chosen/rejected, hh-rlhf or AlpacaEval-annotation format (tasks/align/preferences.py)."))
    max_pairs: int | None = Field(default=None, ge=1, description=(
        "At most this many usable pairs from each source (None: all; demo: 256)."))
    beta: float = Field(default=0.1, gt=0, description="DPO beta: strength of the pull towards the reference model.")
    sft_weight: float = Field(default=0.0, ge=0, description=(
        "Weight of an added NLL loss on the chosen responses (RPO). DPO alone can lower a rejected "
        "reply by garbling the tokens after the point where it departs from the chosen one; this "
        "keeps the chosen replies likely. 0: plain DPO."))
    heldout_fraction: float = Field(default=0.1, gt=0, lt=1, description=(
        "Share of the pairs held out of training to measure preference accuracy and margin."))

    @field_validator("data")
    @classmethod
    def _data_not_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("data must name at least one preference source")
        return value

    def sources(self) -> list[str]:
        return self.data


class GRPOConfig(TrlConfig):
    """Group relative policy optimisation with verifiable rewards (tasks/align/rewards.py);
    prompts that leave no room for max_completion_len tokens within max_seq_len are dropped."""

    prompts: list[str] = Field(default=["demo:arithmetic"], min_length=1, description=(
        "Prompt sources with reference answers: 'demo:arithmetic' or JSONL(.gz) math word problems "
        "(SVAMP context/answer, GSM8K question/answer, question|prompt + answer; see "
        "tasks/align/rewards.py)."))
    max_prompts: int | None = Field(default=None, ge=1, description="At most this many training prompts (None: all).")
    heldout_prompts: int = Field(default=64, ge=1, description=(
        "Held-out prompts (those hashing into the test bucket, core.arithmetic.split_of) whose "
        "greedy accuracy is measured before and after training."))
    num_generations: int = Field(default=8, ge=2, description="Completions sampled per prompt: the group whose "
                                                              "mean reward is each completion's baseline.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of the training completions.")
    max_completion_len: int = Field(default=16, ge=1, description="Tokens generated per completion at most.")
    kl_beta: float = Field(default=0.0, ge=0, description=(
        "Weight of the per-token KL penalty to the reference (SFT) model; 0 skips the reference."))
    format_weight: float = Field(default=0.1, ge=0, description=(
        "Weight of the format reward (ends with the answer sentence) beside the numeric match "
        "(weight 1)."))
    scale_rewards: Literal["group", "batch", "none"] = Field(default="batch", description=(
        "Advantage = reward - group mean, divided by the std of its group, of the whole batch, or "
        "nothing. 'group' blows a small format difference within an all-wrong group up to the "
        "size of a right answer, rewarding wrong answers; 'batch' keeps the rewards' proportions."))

    def sources(self) -> list[str]:
        return self.prompts


class RewardModelConfig(TrlConfig):
    """How the reward model is trained (the shared training config; batch_size counts pairs).
    Pairs with a side longer than max_seq_len are dropped (counted as dropped_rm_too_long)."""

    center_rewards_coef: float = Field(default=0.01, ge=0, description=(
        "Weight of the mean squared reward added to the loss, which keeps scores centred on 0 "
        "(Eisenstein et al. 2023) so PPO's kl_coef means the same across runs; 0 disables."))


class PPOMethodConfig(StageConfig):
    """RLHF: a reward model trained on preference pairs, then PPO against it. Each of the two
    trainings has its own section of the shared training config (`reward_model`, `policy`);
    the held-out split is drawn with reward_model.seed."""

    data: list[str] = Field(default=["demo:arithmetic"], min_length=1, description=(
        "Preference sources for the reward model (formats as dpo.data); their prompts are PPO's "
        "prompts."))
    max_pairs: int | None = Field(default=None, ge=1, description="At most this many usable pairs per source.")
    heldout_fraction: float = Field(default=0.2, gt=0, lt=1, description=(
        "Share of the pairs held out: reward-model accuracy and the policy's held-out score."))
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig,
                                            description="Reward-model training (Bradley-Terry).")
    policy: PPOConfig = Field(default_factory=PPOConfig, description="PPO rollouts and updates.")

    def sources(self) -> list[str]:
        return self.data


class Config(StageConfig):
    """Alignment: the method, one config section per method (only the chosen one is hashed), LoRA,
    and the launch (for every method, the reward model of ppo included)."""

    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"launch"})

    lora: LoraConfig | None = Field(default=None, description="Train LoRA adapters on the frozen SFT model "
                                                              "(None: full fine-tuning). The export merges them.")
    method: Literal["dpo", "grpo", "ppo"] = Field(
        default="dpo", description="Alignment algorithm; its settings are the section of the same name.")
    dpo: DPOConfig = Field(default_factory=DPOConfig,
                           description="Settings of method 'dpo' (preference pairs, TRL DPOTrainer).")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig,
                             description="Settings of method 'grpo' (verifiable rewards, TRL GRPOTrainer).")
    ppo: PPOMethodConfig = Field(
        default_factory=PPOMethodConfig,
        description="Settings of method 'ppo' (a reward model, then PPO against it).")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description=(
        "The processes the method (and ppo's reward model) trains in: inline, or data-parallel under "
        "Accelerate or Ray Train (operational)."))

    def hashed_dict(self) -> dict[str, Any]:
        """Only the chosen method's section changes the output."""
        data = super().hashed_dict()
        for name in set(get_args(type(self).model_fields["method"].annotation)) - {self.method}:
            data.pop(name, None)
        return data

    def method_config(self) -> MethodSection:
        """The chosen method's section: the field named after it (a method added in a subclass of
        Config adds its field there)."""
        return getattr(self, self.method)

    def train_device(self) -> str:
        """The device the chosen method trains on ("auto", "cpu", "cuda"; "auto" for a method whose
        section names none); ppo's reward model trains on the same machine as its policy."""
        section = self.method_config()
        trained = section.policy if isinstance(section, PPOMethodConfig) else section
        return trained.device if isinstance(trained, TrainConfig) else "auto"


# The registry: method name -> the module whose `train(config, job)` trains it (or, in tests, the
# function itself). A name is imported only when its method runs, so planning needs no torch.
METHODS: dict[str, str | TrainFn] = {
    "dpo": "gristmill.tasks.align.dpo",
    "grpo": "gristmill.tasks.align.grpo",
    "ppo": "gristmill.tasks.align.ppo",
}


def fingerprint(config: Config) -> str:
    """Digest of the data files the chosen method reads (its section's `sources()`)."""
    return fingerprint_sources(config.method_config().sources(), JSONL_SUFFIXES)
