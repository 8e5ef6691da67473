"""Preference pairs for alignment: load them from the demo generator or from JSONL files.

Every source becomes the same record, `{"prompt": list[Message], "chosen": str, "rejected": str}`:
a conversation that ends with a user turn, and two candidate assistant replies. Supported sources:

- `demo:arithmetic` — generated arithmetic pairs (core.arithmetic), correct vs near-miss answer;
- a JSONL(.gz) path, its format detected from the keys of its first record:
  - `prompt`/`chosen`/`rejected` (TRL's explicit-prompt format; prompt a string or a message list,
    responses strings or a one-message assistant list),
  - Anthropic hh-rlhf (`chosen`/`rejected` full "\\n\\nHuman: …\\n\\nAssistant: …" transcripts),
  - AlpacaEval annotations (`instruction`, `output_1`, `output_2`, `preference` 1 or 2; 0 = tie).

Bad records are dropped with a snake_case reason, counted per reason, like the collect filters.
"""
from __future__ import annotations

import logging
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gristmill.core.arithmetic as arithmetic
from gristmill.core.chat import Message
from gristmill.core.files import iter_jsonl
from gristmill.core.sources import read_source

log = logging.getLogger("gristmill.align")
DEMO_DEFAULT_PAIRS = 256  # arithmetic pairs generated when no limit is given

Pair = dict[str, Any]
Parsed = Pair | str  # a pair, or the reason it was dropped

_HH_TURN = re.compile(r"\n\n(Human|Assistant): ?")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def _checked(prompt: list[Message], chosen: str, rejected: str) -> Parsed:
    """The pair, or why it is unusable for preference training."""
    if not chosen.strip() or not rejected.strip():
        return "empty_response"
    if chosen == rejected:
        return "same_response"
    if not prompt or prompt[-1]["role"] != "user":
        return "prompt_not_ending_with_user"
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _as_messages(prompt: Any) -> list[Message] | None:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if prompt.strip() else None
    if isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                        for m in prompt):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    return None


def _as_reply(response: Any) -> str | None:
    if isinstance(response, str):
        return response
    if (isinstance(response, list) and len(response) == 1 and isinstance(response[0], dict)
            and response[0].get("role") == "assistant"):
        return str(response[0].get("content", ""))
    return None


def parse_prompt_chosen_rejected(record: dict[str, Any]) -> Parsed:
    prompt = _as_messages(record["prompt"])
    chosen, rejected = _as_reply(record["chosen"]), _as_reply(record["rejected"])
    if prompt is None or chosen is None or rejected is None:
        return "unparseable_record"
    return _checked(prompt, chosen, rejected)


def split_transcript(transcript: str) -> list[Message] | None:
    """An hh-rlhf transcript as messages, or None when it is not a Human/Assistant dialogue."""
    parts = _HH_TURN.split(transcript)
    if parts[0].strip() or len(parts) < 3:
        return None  # text before the first turn marker, or no turn at all
    return [{"role": _HH_ROLES[role], "content": text}
            for role, text in zip(parts[1::2], parts[2::2])]


def parse_hh_rlhf(record: dict[str, Any]) -> Parsed:
    """Split the two transcripts into their shared prefix (the prompt) and final assistant replies."""
    chosen, rejected = split_transcript(record["chosen"]), split_transcript(record["rejected"])
    if chosen is None or rejected is None:
        return "unparseable_transcript"
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        return "unparseable_transcript"
    if chosen[:-1] != rejected[:-1]:
        return "prompt_mismatch"  # the transcripts diverge before their final replies
    return _checked(chosen[:-1], chosen[-1]["content"], rejected[-1]["content"])


def parse_alpaca_eval(record: dict[str, Any]) -> Parsed:
    preference = record["preference"]
    if preference not in (1, 2):
        return "tie" if preference == 0 else "unparseable_record"
    prompt = _as_messages(record["instruction"])
    if prompt is None:
        return "unparseable_record"
    outputs = (str(record["output_1"]), str(record["output_2"]))
    chosen, rejected = outputs if preference == 1 else outputs[::-1]
    return _checked(prompt, chosen, rejected)


# Checked in order: the first whose keys a record has decides the file's format.
FORMATS: dict[str, tuple[frozenset[str], Callable[[dict[str, Any]], Parsed]]] = {
    "prompt_chosen_rejected": (frozenset({"prompt", "chosen", "rejected"}), parse_prompt_chosen_rejected),
    "hh_rlhf": (frozenset({"chosen", "rejected"}), parse_hh_rlhf),
    "alpaca_eval": (frozenset({"instruction", "output_1", "output_2", "preference"}), parse_alpaca_eval),
}


def detect_format(record: dict[str, Any], source: str) -> str:
    for name, (keys, _) in FORMATS.items():
        if keys <= record.keys():
            return name
    raise ValueError(f"{source}: unknown preference format with keys {sorted(record)}; expected one of "
                     + "; ".join(f"{n} {sorted(k)}" for n, (k, _) in FORMATS.items()))


def _demo_pairs(limit: int | None, seed: int) -> list[Pair]:
    rng = random.Random(seed)
    train = arithmetic.problems("train", limit or DEMO_DEFAULT_PAIRS, seed=seed)
    return [arithmetic.preference_pair(p, rng) for p in train]


def _file_pairs(path: Path | str) -> Iterator[Parsed]:
    """Each record of one file as a pair or its drop reason; the first record tells the format."""
    parse = None
    for record in iter_jsonl([path]):
        if parse is None:
            parse = FORMATS[detect_format(record, str(path))][1]
        yield parse(record) if isinstance(record, dict) else "unparseable_record"


def load_preference_pairs(source: str, limit: int | None, *,
                          seed: int = 0) -> tuple[list[Pair], dict[str, int]]:
    """Up to `limit` usable pairs from `source` (first ones in file order; demo pairs are drawn
    with `seed`), and how many records were dropped per reason. No usable pair is a ValueError."""
    demos = {"arithmetic": lambda n: _demo_pairs(n, seed)}
    return read_source(source, "preference source", demos, _file_pairs, limit, "pairs")


def load_pairs(sources: list[str], max_pairs: int | None, seed: int) -> tuple[list[Pair], dict[str, int]]:
    """All sources' pairs (at most `max_pairs` from each), and dropped-record counts summed per reason."""
    pairs: list[Pair] = []
    drops: Counter = Counter()
    for source in sources:
        got, dropped = load_preference_pairs(source, max_pairs, seed=seed)
        log.info("%s: %d pairs, dropped %s", source, len(got), dropped or "none")
        pairs += got
        drops.update(dropped)
    return pairs, dict(drops)


def split_heldout(pairs: list[Pair], fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, heldout): a seeded shuffle, at least one pair on each side."""
    n_heldout = max(1, round(len(pairs) * fraction))
    if len(pairs) - n_heldout < 1:
        raise ValueError(f"heldout_fraction={fraction} leaves no training pair out of {len(pairs)}")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    return [pairs[i] for i in order[n_heldout:]], [pairs[i] for i in order[:n_heldout]]
