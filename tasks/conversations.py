"""Load chat conversations for SFT from the demo generator or from JSONL files of common formats.

A source is `"demo:arithmetic"` (generated problems, tasks/arithmetic.py) or a path to a JSONL
file (optionally gzipped). The format is detected per record by its keys:

    messages                          {"messages": [{"role": ..., "content": ...}, ...]}
    prompt / response (or completion) {"prompt": "...", "response": "..."}; prompt and completion
                                      may also be message lists (TRL's conversational form)
    self-instruct seed tasks          {"instruction": ..., "instances": [{"input", "output"}, ...]}
                                      one conversation per instance

Records that cannot train anything are dropped and counted by a snake_case reason.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from tasks import arithmetic
from tasks.chat import Message
from tasks.stage import iter_jsonl

DEMO_ARITHMETIC = "demo:arithmetic"
DEMO_DEFAULT_EXAMPLES = 500  # of the ~700 train-split problems with operands up to 20
DEMO_SEED = 0  # the demo set is fixed; SFT's own seed shuffles it
ROLES = {"system", "user", "assistant"}


def _as_messages(value: Any, role: str) -> list[Message]:
    """A prompt/completion field: a plain string (one message of `role`) or a message list."""
    if isinstance(value, list):
        return list(value)
    return [{"role": role, "content": value}]


def _self_instruct(record: dict[str, Any]) -> list[list[Message]]:
    convs = []
    for instance in record.get("instances") or []:
        extra = (instance.get("input") or "").strip()
        user = record["instruction"].strip() + (f"\n\n{extra}" if extra else "")
        convs.append([{"role": "user", "content": user},
                      {"role": "assistant", "content": instance.get("output") or ""}])
    return convs


def record_conversations(record: dict[str, Any]) -> list[list[Message]] | None:
    """The conversations in one JSONL record, or None when no known format matches its keys."""
    if "messages" in record:
        return [list(record["messages"])]
    answer_key = "response" if "response" in record else "completion"
    if "prompt" in record and answer_key in record:
        return [_as_messages(record["prompt"], "user") + _as_messages(record[answer_key], "assistant")]
    if "instruction" in record and "instances" in record:
        return _self_instruct(record)
    return None


def drop_reason(messages: list[Message]) -> str | None:
    """Why a conversation cannot be trained on, or None when it is usable."""
    if not isinstance(messages, list) or not messages:
        return "empty_conversation"
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return "malformed_message"
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        return "no_assistant_turn"
    if any(not m["content"].strip() for m in assistant):
        return "empty_assistant_content"
    return None


def _demo(name: str, limit: int | None) -> list[list[Message]]:
    if name != DEMO_ARITHMETIC:
        raise ValueError(f"unknown demo data source {name!r}; known: {DEMO_ARITHMETIC!r}")
    n = limit if limit is not None else DEMO_DEFAULT_EXAMPLES
    return [arithmetic.conversation(p) for p in arithmetic.problems("train", n, seed=DEMO_SEED)]


def _candidates(source: str, limit: int | None):
    """(conversation, None) or (None, reason) for each candidate in the source."""
    if source.startswith("demo:"):
        for conv in _demo(source, limit):
            yield conv, None
        return
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data source {source!r} is neither a demo name nor a file")
    for record in iter_jsonl([path]):
        convs = record_conversations(record) if isinstance(record, dict) else None
        if convs is None:
            yield None, "unknown_format"
        for conv in convs or []:
            yield conv, None


def load_conversations(source: str, limit: int | None = None) -> tuple[list[list[Message]], dict[str, int]]:
    """Up to `limit` usable conversations from `source`, and the counts of dropped ones by reason."""
    convs: list[list[Message]] = []
    dropped: Counter[str] = Counter()
    for conv, reason in _candidates(source, limit):
        reason = reason or drop_reason(conv)
        if reason:
            dropped[reason] += 1
            continue
        convs.append([{"role": m["role"], "content": m["content"]} for m in conv])
        if limit is not None and len(convs) >= limit:
            break
    if not convs:
        raise ValueError(f"no usable conversations in SFT data source {source!r} (dropped: {dict(dropped)})")
    return convs, dict(dropped)
