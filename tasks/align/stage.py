"""Align stage: tune the SFT model with one of the registered methods and export it as `model/`.

Reads the sft stage's `model/` (HF model dir with the chat-template tokenizer). `method`
names an entry of `METHODS`; its config is the section of the same name (`align.dpo`,
`align.grpo`, `align.ppo`) and only that section is hashed into the artifact key. The methods:

- dpo  (dpo.py): preference pairs, TRL's DPOTrainer against the frozen SFT model;
- grpo (grpo.py): math prompts with verifiable rewards (rewards.py), TRL's GRPOTrainer;
- ppo  (ppo.py): a Bradley-Terry reward model (reward_model.py), then our PPO (model/ppo.py).

With `lora:` set, only low-rank adapters train (model/lora.py); the export merges them
(`adapter/` keeps them alone). Checkpoints live in `out_dir/checkpoints`, so running the stage
again on the same `out_dir` after a crash resumes from the last one; they are deleted once the
model is exported.

Adding a method: its section in config.py's `Config`, a module with `train(config, job)` (see
method.py), and one entry in `METHODS` (config.py), which names the module: it is imported only
when the method runs, so planning a run needs neither torch nor TRL.
"""
from __future__ import annotations

import importlib
import logging
from pathlib import Path

import torch

from gristmill.core.stage import Engine, Manifest, StageResult
from gristmill.model.checkpoint import StoreMapping, checkpoint_place
from gristmill.tasks.align.config import METHODS, Config
from gristmill.tasks.align.method import AlignJob, TrainFn

log = logging.getLogger("gristmill.align")


def train_function(method: str | TrainFn) -> TrainFn:
    """The method's `train`: a registered module name is imported here, when the method runs."""
    if isinstance(method, str):
        return importlib.import_module(method).train
    return method


def run(config: Config, out_dir: Path, *, engine: Engine, store_mapping: StoreMapping | None,
        sft: Manifest) -> StageResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    from gristmill.model.export import export_model
    from gristmill.model.lora import export_lora, trainable_parameters
    from gristmill.model.parallel import is_rank0

    out_dir, sft_dir = Path(out_dir), Path(sft.path) / "model"
    log.info("aligning %s with %s", sft_dir, config.method)
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    model = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32)
    job = AlignJob(model=model, tokenizer=tokenizer, out_dir=out_dir, store_mapping=store_mapping, lora=config.lora)
    trained, stats = train_function(METHODS[config.method])(config.method_config(), job)
    params = trainable_parameters(trained)
    artifacts = ["metrics.jsonl"] + (["adapter/adapter_config.json"] if config.lora is not None else [])
    if is_rank0():  # rank 0 of a data-parallel launch; the other ranks hold the same weights
        if config.lora is not None:
            export_lora(trained, tokenizer, out_dir / "model", out_dir / "adapter")
        elif isinstance(trained, PreTrainedModel):
            export_model(trained, tokenizer, out_dir / "model")
        else:
            raise TypeError(f"method {config.method!r} returned a {type(trained).__name__}, not a transformers model")
        # the committed artifact is the export (PPO's checkpoints, below these, on a bucket included)
        checkpoint_place(out_dir, store_mapping).remove()
    return StageResult(stats={"method": config.method, **stats, **params}, artifacts=artifacts)
