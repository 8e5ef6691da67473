"""Helpers shared by the align stage's tests (test_align.py, test_align_grpo.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

import gristmill.tasks.align.stage as align
from gristmill.core.stage import Manifest, SerialEngine

# The TRL trainers' own optimiser defaults (weight decay 0, beta2 0.999), as these tests were sized with.
TRL_ADAMW = dict(weight_decay=0.0, beta2=0.999)


def sft_inputs(root: Path, model_dir: Path) -> dict[str, Manifest]:
    shutil.copytree(model_dir, root / "sft" / "model")
    return {"sft": Manifest.of_directory("sft", root / "sft")}


def run_align(config: align.Config, inputs: dict[str, Manifest], out: Path):
    out.mkdir(exist_ok=True)
    return align.run(config, out, engine=SerialEngine(), store_mapping=None, **inputs)


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")
