"""Load chat conversations for SFT from the demo generator or from JSONL files of common formats.

A source is `"demo:arithmetic"` (generated problems, core/arithmetic.py) or a path to a JSONL
file (optionally gzipped). The format is detected per record by its keys:

    messages                          {"messages": [{"role": ..., "content": ...}, ...]}
    prompt / response (or completion) {"prompt": "...", "response": "..."}; prompt and completion
                                      may also be message lists (TRL's conversational form)
    self-instruct seed tasks          {"instruction": ..., "instances": [{"input", "output"}, ...]}
                                      one conversation per instance

A file whose first record is an OpenAssistant message ({"message_id", "parent_id", "role":
"prompter"|"assistant", "text", ...}; oasst1/oasst2 exports) is read whole as message trees and
flattened into threads (see `oasst_threads`).

Records that cannot train anything are dropped and counted by a snake_case reason.
"""
from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gristmill.core.arithmetic as arithmetic
from gristmill.core.chat import Message
from gristmill.core.files import iter_jsonl
from gristmill.core.sources import read_source

DEMO_DEFAULT_EXAMPLES = 500  # of the ~700 train-split problems with operands up to 20
DEMO_SEED = 0  # the demo set is fixed; SFT's own seed shuffles it
ROLES = {"system", "user", "assistant"}
OASST_KEYS = {"message_id", "parent_id", "role", "text"}
OASST_ROLES = {"prompter": "user", "assistant": "assistant"}


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


# --- OpenAssistant message trees ----------------------------------------------------------------

def is_oasst_message(record: Any) -> bool:
    """Whether a record is one message of an OpenAssistant tree export."""
    return isinstance(record, dict) and record.keys() >= OASST_KEYS


def oasst_message_drop_reason(record: dict[str, Any]) -> str | None:
    """Why a single OpenAssistant message is left out of every thread, or None. Its replies go
    with it (they are counted as unreachable)."""
    if record.get("deleted"):
        return "deleted_message"
    if record.get("review_result") is False:  # None: not reviewed (in oasst1 only on deleted ones)
        return "failed_review_message"
    if record.get("synthetic"):
        return "synthetic_message"
    if record.get("role") not in OASST_ROLES or not isinstance(record.get("text"), str):
        return "malformed_message"
    return None


def _reply_order(record: dict[str, Any]) -> tuple[bool, int]:
    """Best-ranked reply first (rank 0 is the best; unranked ones last), then file order."""
    rank = record.get("rank")
    return rank is None, rank if isinstance(rank, int) else 0


def _paths(node: dict[str, Any], children: dict[str, list], prefix: list) -> Iterator[list]:
    """Every root-to-leaf path through `node` (depth first, replies in `_reply_order`)."""
    path = [*prefix, node]
    replies = sorted(children.get(node["message_id"], []), key=_reply_order)
    if not replies:
        yield path
    for reply in replies:
        yield from _paths(reply, children, path)


def oasst_threads(records: Iterable[dict[str, Any]]) -> tuple[list[list[Message]], Counter[str]]:
    """Flatten OpenAssistant message trees into chat threads, and count the messages left out.

    Threads are every root-to-leaf path, cut back to its last assistant reply (a path ending in
    an unanswered follow-up yields its parent's thread), each distinct thread once. That is the
    flattening OpenAssistant's own SFT used (model_training's `oasst_export` without `top_k`: all
    threads, none through deleted or synthetic messages), rather than only the best-ranked path:
    every reviewed human reply is a demonstration, so all of them train. The cost is that a reply
    high in a tree recurs in every thread below it (the held-out split keeps a tree's threads
    together, see tasks.sft.stage). Threads come best-ranked first (rank 0, then 1, ...; unranked last),
    so a `limit` keeps the best. Roles map prompter -> user. A path with no assistant reply (a
    prompt nobody answered) is returned as is, for the caller to drop as `no_assistant_turn`.
    """
    dropped: Counter[str] = Counter()
    kept: dict[str, dict[str, Any]] = {}
    for record in records:
        reason = oasst_message_drop_reason(record) if is_oasst_message(record) else "unknown_format"
        if reason:
            dropped[reason] += 1
        else:
            kept[record["message_id"]] = record
    children: dict[str, list] = defaultdict(list)
    for record in kept.values():
        if record["parent_id"] is not None:
            children[record["parent_id"]].append(record)
    threads, seen, reached = [], set(), set()
    for root in (r for r in kept.values() if r["parent_id"] is None):
        for path in _paths(root, children, []):
            reached.update(m["message_id"] for m in path)
            last = max((i for i, m in enumerate(path) if m["role"] == "assistant"), default=len(path) - 1)
            key = tuple(m["message_id"] for m in path[: last + 1])
            if key not in seen:
                seen.add(key)
                threads.append([{"role": OASST_ROLES[m["role"]], "content": m["text"]} for m in path[: last + 1]])
    if len(kept) > len(reached):  # replies to dropped messages, or to parents absent from the file
        dropped["unreachable_message"] += len(kept) - len(reached)
    return threads, dropped


def _demo(limit: int | None) -> list[list[Message]]:
    n = limit if limit is not None else DEMO_DEFAULT_EXAMPLES
    return [arithmetic.conversation(p) for p in arithmetic.problems("train", n, seed=DEMO_SEED)]


def _file_candidates(path: Path | str) -> Iterator[list[Message] | str]:
    """A conversation, or the reason it was dropped, for each candidate in one file; the first
    record tells whether the file is an OpenAssistant message tree export."""
    records = iter(iter_jsonl([path]))
    first = next(records, None)
    records = itertools.chain([first] if first is not None else [], records)
    if is_oasst_message(first):
        threads, dropped = oasst_threads(records)
        for reason, n in dropped.items():
            yield from [reason] * n
        yield from threads
        return
    for record in records:
        convs = record_conversations(record) if isinstance(record, dict) else None
        if convs is None:
            yield "unknown_format"
        yield from convs or []


def _file_conversations(path: Path | str) -> Iterator[list[Message] | str]:
    """Each usable conversation of one file (only role and content kept), or a drop reason."""
    for candidate in _file_candidates(path):
        if isinstance(candidate, str):
            yield candidate
        elif reason := drop_reason(candidate):
            yield reason
        else:
            yield [{"role": m["role"], "content": m["content"]} for m in candidate]


def load_conversations(source: str, limit: int | None = None) -> tuple[list[list[Message]], dict[str, int]]:
    """Up to `limit` usable conversations from `source`, and the counts of dropped ones by reason."""
    return read_source(source, "SFT data source", {"arithmetic": _demo}, _file_conversations, limit,
                       "conversations")
