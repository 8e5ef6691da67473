"""Greedy generation for chat evaluations: held-out accuracy in alignment and in the evaluate stage."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from core.chat import IM_END


def generate_greedy(model: Any, tokenizer: Any, prompts: Sequence[list[int]], max_new_tokens: int,
                    device: str, batch_size: int | None = None) -> list[str]:
    """Greedy completions of left-padded prompts (token ids), each cut at the first `<|im_end|>`;
    `batch_size` prompts per `generate` call (None: all at once)."""
    if batch_size is not None and len(prompts) > batch_size:
        return [text for start in range(0, len(prompts), batch_size)
                for text in generate_greedy(model, tokenizer, prompts[start:start + batch_size],
                                            max_new_tokens, device)]
    pad_id, stop_id = tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids(IM_END)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=stop_id, pad_token_id=pad_id)
    texts = []
    for row in out[:, width:].tolist():
        row = row[: row.index(stop_id)] if stop_id in row else row
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts
