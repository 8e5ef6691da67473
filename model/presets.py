"""Model presets: named Llama-style shapes from a CPU toy to ~7B, their analytic parameter
counts, and a stock `LlamaForCausalLM` built from a config (`ModelConfig`, model/config.py).

Stock architectures only, so every exported model loads with `AutoModelForCausalLM` and no
`trust_remote_code`. Seeding the initialisation is the caller's job (`torch.manual_seed` first).
"""
from __future__ import annotations

from typing import Any

from gristmill.model.config import ModelConfig


def build_model(cfg: ModelConfig, tokenizer: Any) -> Any:
    """A randomly initialised `LlamaForCausalLM` with the tokenizer's vocabulary and special ids,
    tied input/output embeddings, and PyTorch SDPA attention."""
    # imported here: the presets' shapes and counts (`gristmill plan`) need no transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def count_params(model: Any) -> int:
    """Distinct parameters of a built model (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


PLAN_VOCAB_SIZE = 32_000  # vocabulary assumed for presets' parameter counts (Llama-2's)

# Llama-style shapes (SwiGLU MLP, RoPE, RMSNorm, tied embeddings, no grouped-query sharing).
# Parameter counts at PLAN_VOCAB_SIZE: tiny 4.6M, 125m 124M, 1b 0.99B, 7b 6.6B.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512, max_seq_len=256),
    "125m": ModelConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2560, max_seq_len=2048),
    "1b": ModelConfig(hidden_size=2048, num_layers=18, num_heads=16, intermediate_size=5632, max_seq_len=2048),
    "7b": ModelConfig(hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008,
                      max_seq_len=4096),
}


def config_params(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters of `build_model(cfg, tokenizer)` for a vocabulary of `vocab_size`, computed from
    the shape alone: tied embedding + per layer (q, k, v, o projections, SwiGLU gate/up/down, two
    RMSNorm weights) + the final norm."""
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    per_layer = 4 * h * h + 3 * h * ffn + 2 * h
    return vocab_size * h + cfg.num_layers * per_layer + h


def non_embedding_params(cfg: ModelConfig) -> int:
    """Parameters in the transformer blocks (the N of 6*N*D FLOP estimates excludes the embedding)."""
    return config_params(cfg, vocab_size=0)


def preset(name: str) -> ModelConfig:
    """The named preset; an unknown name is an error listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
