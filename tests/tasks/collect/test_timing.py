"""Where a collect worker's time goes (tasks/collect/timing.py): its cold start, part by part, in a
fresh process, and its seconds per step, from each unit's result to the stage's measurements."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import gristmill.tasks.collect.stage as collect
from gristmill.core.stage import SerialEngine

PER_RECORD = {"read_extract", "url_filter", "language_id", "quality_filters", "pii", "decontamination", "write"}
CORPUS = {"merge", "exact_dedup", "minhash_signatures", "near_dedup", "mix", "write_shards"}

FRESH_WORKER = """
import json, sys
from gristmill.tasks.collect.timing import load_worker
from gristmill.tasks.collect.clean.rules import split_words
from datatrove.utils.text import split_into_words
parts = load_worker()
torch_loaded = "torch" in sys.modules
text = open(sys.argv[1], encoding="utf-8").read()[:20000]
same_words = split_words(text) == split_into_words(text)
import torch  # imports as usual after spaCy
print(json.dumps({"parts": parts, "torch_loaded": torch_loaded, "same_words": same_words,
                  "torch_works": float(torch.ones(2).sum()) == 2.0}))
"""


def test_a_fresh_worker_times_each_part_of_its_start_and_loads_spacy_without_torch(shared_data):
    """spaCy's import pulls torch in through thinc unless the worker hides it; the words are still
    datatrove's, and torch still imports afterwards."""
    proc = subprocess.run([sys.executable, "-c", FRESH_WORKER, str(shared_data / "corpus" / "botchan_en.txt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got["parts"]) == {"spacy_import", "word_tokenizer", "fasttext", "trafilatura"}
    assert all(seconds > 0 for seconds in got["parts"].values()), got["parts"]
    assert got == {**got, "torch_loaded": False, "same_words": True, "torch_works": True}


def test_every_unit_times_its_steps_and_the_stage_measures_them_apart_from_its_stats(shared_data, tmp_path,
                                                                                    monkeypatch):
    """Each unit's result ends with its seconds per step (and its process's cold start, once per
    process); the stage sums them into `measured`, beside its corpus-level steps, and its
    `stats` (a function of the input) hold none of them."""
    monkeypatch.setattr(collect, "_worker_loaded", False)  # as in a fresh worker process
    sources = [str(shared_data / "warc" / "ukwa_test_suite"), str(shared_data / "jsonl" / "dolma_cc")]
    out = tmp_path / "out"
    out.mkdir()
    units = collect.plan_units(collect.Config(sources=sources), out)
    lines = []
    for unit in units[:2]:
        result = collect.process_unit((unit, collect.unit_result_path(tmp_path, unit)))
        with gzip.open(result, "rt") as events:
            *_, last = (json.loads(line) for line in events)
        lines.append(last[collect.TIMING])
    assert set(lines[0]["cold_start"]) == {"spacy_import", "word_tokenizer", "fasttext", "trafilatura"}
    assert lines[1]["cold_start"] == {}  # its process had loaded them
    assert set(lines[0]["steps"]) >= {"read_extract", "write"}

    monkeypatch.setattr(collect, "_worker_loaded", False)
    result = collect.run(collect.Config(sources=sources, decontam={"eval_sets": [
        str(shared_data / "eval" / "arc_easy" / "arc_easy_part1.jsonl")]}), out, engine=SerialEngine())
    measured = result.measured
    assert {k.removeprefix("step_s_") for k in measured if k.startswith("step_s_")} == PER_RECORD | CORPUS
    assert all(measured[f"step_s_{step}"] > 0 for step in PER_RECORD), measured
    assert measured["cold_start_processes"] == 1 and measured["cold_start_s_spacy_import"] >= 0
    assert not any(k.startswith(("step_s_", "cold_start_")) for k in result.stats)
