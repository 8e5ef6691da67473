"""Which benchmark items a model may have seen: each item's 13-grams (core/decontam.py: normalized
words, short items whole) against the text of the data in the model's lineage.

The training text is the collect stage's documents (what pretraining read) and every record of
the SFT and alignment data sources named in those stages' configs (all string fields of each
record: prompts, replies, rejected replies alike). `demo:arithmetic` stands for every problem the
generator can make, with its answer: a superset of what training saw, so never an undercount.

Each model is checked against what it was trained on: base against the collect documents, SFT
against those and the SFT data, aligned against all three. A contaminated item is still scored;
next to each task's full score stand the number of contaminated items and the accuracy on the
clean rest (`contaminated`, `n_clean`, `acc_clean`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import gristmill.core.arithmetic as arithmetic
from gristmill.core.decontam import DecontamConfig, all_strings, index_items
from gristmill.core.files import iter_jsonl
from gristmill.core.sources import JSONL_SUFFIXES, parse_source, source_files
from gristmill.core.stage import Manifest
from gristmill.tasks.evaluate.formats import read_records, task_name

# Config fields of the training stages that name their data sources (sft.data, align.<method>.data,
# align.grpo.prompts).
SOURCE_FIELDS = ("data", "prompts")
DOCS_GLOB = "docs/*.jsonl.gz"  # the collect stage's output documents


def training_sources(config: Mapping[str, Any]) -> list[str]:
    """Every source string under a SOURCE_FIELDS key anywhere in a stage's resolved config; with a
    `method` key (align), only the chosen method's section counts: the others' data was not used."""
    found: list[str] = []
    chosen = config.get("method")
    for key, value in config.items():
        if isinstance(value, Mapping):
            if isinstance(chosen, str) and chosen in config and key != chosen:
                continue
            found += training_sources(value)
        elif key in SOURCE_FIELDS and isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, str)]
    return list(dict.fromkeys(found))


def _source_texts(source: str) -> Iterator[str]:
    if parse_source(source).kind != "files":  # the only demo is the arithmetic generator
        for p in arithmetic.universe():
            yield f"{p.question} {arithmetic.answer_text(p.answer)}"
        return
    for record in iter_jsonl(source_files(source, JSONL_SUFFIXES)):
        yield " ".join(all_strings(record))


def training_texts(lineage: Iterable[Manifest]) -> Iterator[str]:
    """The text of every training record in the lineage given: a collect manifest's documents, the
    data sources of a training stage's (sft, align) config."""
    for manifest in lineage:
        if manifest.stage == "collect":
            for doc in iter_jsonl(sorted(Path(manifest.path).glob(DOCS_GLOB))):
                yield doc["text"]
        else:
            for source in training_sources(manifest.config):
                yield from _source_texts(source)


def contaminated_items(tasks: Mapping[str, list[tuple[str, dict]]], texts: Iterator[str],
                       config: DecontamConfig = DecontamConfig()) -> dict[str, set[str]]:
    """task -> ids of its items sharing an n-gram with any of `texts`, from {task: [(id, record)]}."""
    index = index_items(config, dict(tasks))
    for number, text in enumerate(texts):
        index.record(str(number), index.find(text))
    found: dict[str, set[str]] = {task: set() for task in tasks}
    for task, item in index.found:
        found[task].add(item)
    return found


# model label -> the training data in its lineage
SEEN_BY = {"base": ("collect",), "sft": ("collect", "sft"), "aligned": ("collect", "sft", "align")}


def mark_items(task_paths: list[str], limit: int | None,
               lineage: Iterable[Manifest]) -> dict[str, dict[str, list[int]]]:
    """{model label: {task: indices of its items found in that model's training data}}, from the
    lineage's collect, sft and align manifests; item indices are positions among the first `limit`
    records, as the engine numbers them."""
    items = {task_name(Path(p)): [(str(i), r) for i, r in enumerate(read_records(Path(p), limit))]
             for p in task_paths}
    found = {part.stage: contaminated_items(items, training_texts([part])) for part in lineage}
    return {label: {task: sorted({int(i) for part in parts if part in found for i in found[part][task]})
                    for task in items}
            for label, parts in SEEN_BY.items()}


def clean_scores(rows: list[dict[str, Any]], marked: list[int]) -> dict[str, Any]:
    """How many scored items are contaminated, and the accuracy on the others (None when none is
    clean)."""
    seen = set(marked)
    clean = [float(r["correct"]) for r in rows if r["id"] not in seen]
    return {"contaminated": len(rows) - len(clean), "n_clean": len(clean),
            "acc_clean": sum(clean) / len(clean) if clean else None}
