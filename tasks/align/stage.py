"""Align stage: tune the SFT model with one of the registered methods and export it as `model/`.

Reads `inputs["sft"].path / "model"` (HF model dir with the chat-template tokenizer). `method`
names an entry of `METHODS`; its settings are the config section of the same name (`align.dpo`,
`align.grpo`, `align.ppo`) and only that section is hashed into the artifact key. The methods:

- dpo  (dpo.py): preference pairs, TRL's DPOTrainer against the frozen SFT model;
- grpo (grpo.py): math prompts with verifiable rewards (rewards.py), TRL's GRPOTrainer;
- ppo  (ppo.py): a Bradley-Terry reward model (reward_model.py), then our PPO (model/ppo.py).

With `lora:` set, only low-rank adapters train (model/lora.py); the export merges them
(`adapter/` keeps them alone). Checkpoints live in `out_dir/checkpoints`, so running the stage
again on the same `out_dir` after a crash resumes from the last one; they are deleted once the
model is exported.

Adding a method: write a module with its settings class and `train(settings, job)` (see
method.py), and add one entry to `METHODS` below.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Literal, Mapping, get_args

import torch
from pydantic import Field, create_model

from core.sources import JSONL_SUFFIXES, fingerprint_sources
from core.stage import Engine, Manifest, StageConfig, StageResult
from model.lora import LoraSettings
from tasks.align import dpo, grpo, ppo
from tasks.align.method import AlignJob, Method

VERSION = 3  # 3: one settings section per method, shared training settings (core.settings)
log = logging.getLogger("gristmill.align")

# The registry: method name -> its settings section and training function.
METHODS: dict[str, Method] = {"dpo": dpo.METHOD, "grpo": grpo.METHOD, "ppo": ppo.METHOD}


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


def run(config: AlignConfigBase, inputs: Mapping[str, Manifest], out_dir: Path, *, engine: Engine) -> StageResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.export import export_model
    from model.lora import export_lora, trainable_parameters

    out_dir, sft_dir = Path(out_dir), Path(inputs["sft"].path) / "model"
    log.info("aligning %s with %s", sft_dir, config.method)
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    model = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32)
    job = AlignJob(model=model, tokenizer=tokenizer, out_dir=out_dir, lora=config.lora)
    trained, stats = METHODS[config.method].train(config.method_settings(), job)
    params = trainable_parameters(trained)
    artifacts = ["metrics.jsonl"]
    if config.lora is not None:
        export_lora(trained, tokenizer, out_dir / "model", out_dir / "adapter")
        artifacts.append("adapter/adapter_config.json")
    else:
        export_model(trained, tokenizer, out_dir / "model")
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)  # the committed artifact is the export
    return StageResult(stats={"method": config.method, **stats, **params}, artifacts=artifacts)
