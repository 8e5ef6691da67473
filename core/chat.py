"""The one chat template, its special tokens, and rendering with an assistant-token loss mask.

Defined here once; the tokenize stage saves it into the tokenizer directory, and every later stage
(SFT, alignment, evaluation, export) uses the template stored with the tokenizer.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DOC_SEPARATOR = "<|endoftext|>"  # between pretraining documents; also BOS
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # ends every chat turn; the chat model's EOS
SPECIAL_TOKENS = [DOC_SEPARATOR, PAD, IM_START, IM_END]

# ChatML. `{% generation %}` marks the assistant tokens that carry the loss, so
# `apply_chat_template(..., return_assistant_tokens_mask=True)` (and TRL) can build the mask.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{{- '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

Message = dict[str, str]


def render_with_mask(tokenizer: Any, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a 0/1 mask that is 1 exactly on assistant tokens
    (content and the closing `<|im_end|>`), the tokens SFT trains on."""
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def prompt_ids(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of a conversation followed by the assistant header, ready for generation."""
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=True, return_dict=True
    )
    return list(out["input_ids"])
