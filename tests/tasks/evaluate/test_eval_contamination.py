"""Contamination beside every score: a benchmark item is marked when its n-grams occur in the
training data of the model's lineage (collect documents, SFT/alignment sources), and only then."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from gristmill.core.stage import Manifest
from gristmill.tasks.evaluate.contamination import (
    contaminated_items,
    training_sources,
    training_texts,
)


def _items(path: Path, n: int) -> list[tuple[str, dict]]:
    lines = path.read_text().splitlines()[:n]
    return [(str(i), json.loads(line)) for i, line in enumerate(lines)]


def _manifest(stage: str, path: Path, config: dict) -> Manifest:
    return Manifest(stage=stage, key="k", path=path, config=config, upstream={}, files={}, stats={})


def test_items_found_in_crawl_or_sft_data_are_marked_and_no_others(tmp_path, shared_data):
    hellaswag = _items(shared_data / "eval" / "hellaswag" / "hellaswag_val_part1.jsonl", 30)
    gsm8k = _items(shared_data / "eval" / "gsm8k" / "test_part1.jsonl", 30)
    # a crawled page quoting HellaSwag item 7 (other case, extra text), and an SFT file whose
    # prompt is GSM8K item 12's question
    ctx, ending = hellaswag[7][1]["ctx"], hellaswag[7][1]["endings"][hellaswag[7][1]["label"]]
    collect = tmp_path / "collect"
    (collect / "docs").mkdir(parents=True)
    speech = (shared_data / "corpus" / "nltk_inaugural" / "2009-Obama.txt").read_text()
    with gzip.open(collect / "docs" / "part-00000.jsonl.gz", "wt") as f:
        for text in (speech, f"Forum post. {ctx.upper()} {ending} Thanks!"):
            f.write(json.dumps({"id": "d", "text": text}) + "\n")
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text(json.dumps({"prompt": gsm8k[12][1]["question"], "response": "42"}) + "\n")
    inputs = {"collect": _manifest("collect", collect, {}),
              "sft": _manifest("sft", tmp_path, {"data": [str(sft_file)], "lr": 1e-3}),
              "align": _manifest("align", tmp_path, {"method": "grpo",
                                                     "grpo": {"prompts": ["demo:arithmetic"]}})}
    found = contaminated_items({"hellaswag": hellaswag, "gsm8k": gsm8k}, training_texts(inputs.values()))
    assert found == {"hellaswag": {"7"}, "gsm8k": {"12"}}
    # without the lineage's data nothing is marked: the marks come from the training text
    assert contaminated_items({"hellaswag": hellaswag, "gsm8k": gsm8k},
                              iter([speech])) == {"hellaswag": set(), "gsm8k": set()}


def test_training_sources_are_read_from_the_stage_configs():
    config = {"method": "dpo", "dpo": {"data": ["a.jsonl", "demo:arithmetic"], "beta": 0.1},
              "grpo": {"prompts": ["b.jsonl"]}, "data_seed": 3}
    assert training_sources(config) == ["a.jsonl", "demo:arithmetic"]  # not grpo's: unused
    assert training_sources({"data": ["c.jsonl"], "lr": 1e-3}) == ["c.jsonl"]
