"""LoRA adapters (PEFT) for the fine-tuning stages: wrapping a model, and export.

`LoraConfig` (model/config.py; `apply_lora` builds peft's class of that name from it) is the one
typed config of low-rank adapters; a stage config holds `lora: LoraConfig | None` (None: full
fine-tuning). `apply_lora` freezes the base model and adds trainable rank-`rank` matrices A, B
beside each targeted linear layer W, so the layer computes W x + (alpha / rank) * B A x; B starts
at zero, so the wrapped model starts equal to the base.
`export_lora` writes the adapter alone (`adapter/`, loadable with peft onto the base model) and the
merged plain model (W + (alpha / rank) * B A folded into W), which loads with
`AutoModelForCausalLM` and needs no peft.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gristmill.model.config import LoraConfig
from gristmill.model.export import export_model

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

LORA_PARAM_MARKER = "lora_"  # PEFT names the adapter matrices lora_A / lora_B


def _peft():
    try:
        import peft
    except ImportError as exc:  # an optional dependency of the LoRA path only
        raise ImportError("LoRA fine-tuning needs peft: pip install peft") from exc
    return peft


def apply_lora(model: PreTrainedModel, cfg: LoraConfig) -> PeftModel:
    """`model` wrapped as a PEFT model: base weights frozen, adapters trainable. Adapter A is drawn
    from torch's global RNG, so seed it first for a reproducible start."""
    peft = _peft()
    missing = [name for name in cfg.target_modules
               if not any(n.split(".")[-1] == name for n, _ in model.named_modules())]
    if missing:
        raise ValueError(f"lora.target_modules {missing} name no submodule of {type(model).__name__}")
    # peft annotates lora_alpha as int, but only divides it by r: a float alpha is used as given.
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha,  # pyright: ignore[reportArgumentType]
                             lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), bias="none",
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def trainable_parameters(model: torch.nn.Module) -> dict[str, int]:
    """{"params_trainable": ..., "params_total": ...} (tied weights counted once)."""
    params = list(model.parameters())
    return {"params_trainable": sum(p.numel() for p in params if p.requires_grad),
            "params_total": sum(p.numel() for p in params)}


def export_lora(peft_model: Any, tokenizer: Any, model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """Save the adapter to `adapter_dir`, then merge it into the base weights and export the plain
    model to `model_dir` (see model.export). Returns the merged model; `peft_model` is consumed
    (its layers are unwrapped in place)."""
    adapter_dir = Path(adapter_dir)
    peft_model.save_pretrained(adapter_dir)
    merged = peft_model.merge_and_unload()
    export_model(merged, tokenizer, model_dir)
    return merged
