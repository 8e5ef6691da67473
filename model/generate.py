"""Greedy generation for chat evaluations: held-out accuracy in alignment and in the evaluate stage."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gristmill.core.chat import IM_END


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


def generate_text(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, device: str,
                  batch_size: int, stop: Sequence[str] = (), num_samples: int = 1,
                  temperature: float = 0.0, max_length: int | None = None) -> list[list[str]]:
    """Completions of plain-text prompts for any causal LM: `num_samples` per prompt (greedy when
    `temperature` is 0), each cut before the first of the `stop` strings. Prompts are encoded with
    the tokenizer's own special tokens and left-padded, as lm-eval's HFLM does; with `max_length`,
    a prompt keeps its last max_length - max_new_tokens tokens."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sample = temperature > 0
    out: list[list[str]] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [tokenizer.encode(p) for p in prompts[start:start + batch_size]]
        if max_length is not None:
            encoded = [e[-(max_length - max_new_tokens):] for e in encoded]
        width = max(len(e) for e in encoded)
        ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
        kwargs = {"do_sample": True, "temperature": temperature} if sample else {"do_sample": False}
        with torch.no_grad():
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                       num_return_sequences=num_samples, pad_token_id=pad_id,
                                       stop_strings=list(stop) or None, tokenizer=tokenizer, **kwargs)
        texts = [cut_at(tokenizer.decode(row, skip_special_tokens=True), stop)
                 for row in generated[:, width:].tolist()]
        out += [texts[i:i + num_samples] for i in range(0, len(texts), num_samples)]
    return out


def cut_at(text: str, stop: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string (lm-eval's generate_until cut)."""
    for term in stop:
        text = text.split(term)[0]
    return text
