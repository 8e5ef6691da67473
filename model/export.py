"""Export a trained model as a self-contained HF directory (safetensors, config, generation
config, tokenizer with its chat template) that loads with `AutoModelForCausalLM` and
`AutoTokenizer` without `trust_remote_code`."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from gristmill.core.chat import DOC_SEPARATOR, IM_END
from gristmill.model.parallel import full_model_state, is_rank0, is_sharded, with_aliases


def generation_config(tokenizer: Any) -> GenerationConfig:
    """Generation stops at the end of a chat turn or at a document boundary."""
    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(DOC_SEPARATOR)]
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in eos:
        raise ValueError(f"tokenizer lacks {IM_END} or {DOC_SEPARATOR}; it must come from the tokenize stage")
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                            pad_token_id=tokenizer.pad_token_id)


def _unsharded(model: PreTrainedModel) -> PreTrainedModel | None:
    """A plain copy of `model` on rank 0's CPU (None on other ranks); for a sharded model every
    rank must call it, as its weights are gathered."""
    if not is_sharded(model):
        return model if is_rank0() else None
    state = full_model_state(model)
    if not is_rank0():
        return None
    copy = AutoModelForCausalLM.from_config(model.config)
    copy.load_state_dict(with_aliases(copy, state))
    return copy


def export_model(model: PreTrainedModel, tokenizer: Any, out_dir: Path) -> Path:
    """Write `model` and `tokenizer` to `out_dir` (replaced if it exists, e.g. after a crash
    mid-export) from rank 0. Every rank of a sharded (FSDP) model must call it: its full weights
    are gathered first; a replicated model needs only rank 0. Weights are saved as safetensors only."""
    out_dir = Path(out_dir)
    whole = _unsharded(model)
    if whole is None:
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    whole.generation_config = generation_config(tokenizer)
    whole.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stray = [p.name for p in out_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
    if stray:
        raise RuntimeError(f"export wrote non-safetensors weights {stray} to {out_dir}")
    return out_dir
