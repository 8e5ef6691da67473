"""The align stage's contract without its training code: the `METHODS` registry, `Config`
(built from it), `VERSION` and `fingerprint`.

Planning a run (flows/config.py, flows/dag.py: a `--dry-run`, a config mistake) needs only these,
so the registry names each method's settings class (settings.py, no torch) and the module of its
training function, which the stage imports only when the method runs (stage.py).
"""
from __future__ import annotations

from typing import Any, Literal, Mapping, get_args

from pydantic import Field, create_model

from core.sources import JSONL_SUFFIXES, fingerprint_sources
from core.stage import StageConfig
from model.settings import LoraSettings
from tasks.align.method import Method
from tasks.align.settings import DPOSettings, GRPOSettings, PPOMethodSettings

VERSION = 3  # 3: one settings section per method, shared training settings (core.settings)

# The registry: method name -> its settings section, the module of its `train`, and a description.
METHODS: dict[str, Method] = {
    "dpo": Method(DPOSettings, "tasks.align.dpo", "Settings of method 'dpo' (preference pairs, TRL DPOTrainer)."),
    "grpo": Method(GRPOSettings, "tasks.align.grpo",
                   "Settings of method 'grpo' (verifiable rewards, TRL GRPOTrainer)."),
    "ppo": Method(PPOMethodSettings, "tasks.align.ppo",
                  "Settings of method 'ppo' (a reward model, then PPO against it)."),
}


class AlignConfigBase(StageConfig):
    """What every method shares; `config_class` adds `method` and one section per method."""

    lora: LoraSettings | None = Field(None, description="Train LoRA adapters on the frozen SFT model "
                                                        "(None: full fine-tuning). The export merges them.")

    def hashed_dict(self) -> dict[str, Any]:
        """Only the chosen method's settings section changes the output."""
        data = super().hashed_dict()
        for name in set(get_args(type(self).model_fields["method"].annotation)) - {self.method}:
            data.pop(name, None)
        return data

    def method_settings(self) -> StageConfig:
        """The chosen method's settings section."""
        return getattr(self, self.method)


def config_class(methods: Mapping[str, Method]) -> type[AlignConfigBase]:
    """The stage's config type for a registry: `method` (one of its names) and a section per method."""
    names = tuple(methods)
    return create_model(
        "Config", __base__=AlignConfigBase, __doc__="Alignment: the method, its settings section, optional LoRA.",
        method=(Literal[names], Field(names[0], description="Alignment algorithm; its settings are the "
                                                            "section of the same name.")),
        **{name: (m.settings, Field(default_factory=m.settings, description=m.description))
           for name, m in methods.items()})


Config = config_class(METHODS)


def fingerprint(config: AlignConfigBase) -> str:
    """Digest of the data files the chosen method reads (its settings' `sources()`)."""
    return fingerprint_sources(config.method_settings().sources(), JSONL_SUFFIXES)
