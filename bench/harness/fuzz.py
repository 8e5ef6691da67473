"""Fuzzing the collect stage's readers and cleaning chain with damaged input files
(`python -m bench.fuzz` runs `run_fuzz`; tests/tasks/collect/test_fuzz.py runs single trials).

A trial generates one to four input files, each from a fault kind in FAULTS (bench/harness/damaged.py:
random bytes, truncated or corrupted gzip and zstd, broken WARC headers, multi-MB lines, mixed and invalid
encodings, empty files, JSON lines that are not objects or lack `text`, Parquet/Arrow garbage),
adds one intact JSONL source (so the stage has documents to finish with, and a damaged copy of
them meets its original in dedup), and runs the whole collect stage over them, each file a source
of its own. A trial survives when

  - no exception escapes the stage (every fault must be a counted drop or a quarantined entry),
  - its accounting holds, in total and per source: in = kept + dropped + quarantined (the stage
    checks this itself; the trial re-reads funnel.json and the output shards),
  - every file whose record count is known (intact ones: one record per non-blank JSON line, one
    per WARC record, one per Parquet/Arrow row, one per text file) shows exactly that many
    records read: a reader that swallowed a record would balance its books and still lose it.

Determinism: each trial draws everything from `random.Random(f"{seed}:{trial}")`, and the
files it writes (gzip with mtime 0, zstd, Parquet/Arrow in memory) are byte-identical for a seed,
so `run_fuzz` returns the same result for the same seed. Plain `random` rather than hypothesis:
the benchmark must replay a seed exactly without hypothesis' example database or shrinking, and
the fault generators are reused by tests/tasks/collect/test_fuzz.py, where hypothesis draws the kind and the
seed (and shrinks the byte-level cases it generates itself).
"""
from __future__ import annotations

import gzip
import json
import random
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.damaged import (
    BOM,
    FAULTS,
    MAX_DOC_BYTES,
    PROSE,
    FuzzFile,
    count_jsonl_records,
    jsonl,
)

# The generators' names are part of this module's interface: a fuzzing test reads both from here.
__all__ = ["BOM", "FAULTS", "MAX_DOC_BYTES", "PROSE", "FuzzFile", "Trial", "count_jsonl_records", "jsonl",
           "run_fuzz", "run_trial", "trial_files"]


@dataclass(frozen=True, kw_only=True)
class Trial:
    """What one trial found."""

    survived: bool
    docs_lost: int  # |in - kept - dropped - quarantined|, summed over sources
    records_unread: int  # |known records - in|, summed over the files whose count is known
    failure: str | None  # why it did not survive


def run_trial(files: Sequence[FuzzFile], workdir: Path, texts: Sequence[str] = PROSE,
              anchor_weight: float = 1.0) -> Trial:
    """Run the collect stage over `files` plus an intact JSONL source of `texts` (first), each a
    source of its own, in `workdir`; check what the module docstring lists."""
    from gristmill.core.stage import SerialEngine
    from gristmill.tasks.collect.config import Config
    from gristmill.tasks.collect.output.mixing import MixConfig
    from gristmill.tasks.collect.stage import run

    shutil.rmtree(workdir, ignore_errors=True)
    inputs, out = workdir / "in", workdir / "out"
    inputs.mkdir(parents=True)
    out.mkdir()
    anchor = FuzzFile(kind="anchor", name="anchor.jsonl", data=jsonl(random.Random(0), texts),
                      records=len(texts))
    paths = []
    for i, f in enumerate([anchor, *files]):
        paths.append(inputs / f"{i:02d}-{f.name}")
        paths[-1].write_bytes(f.data)
    config = Config(sources=[str(p) for p in paths], max_doc_bytes=MAX_DOC_BYTES, num_workers=1,
                    review_samples=2, blocked_domains=("blocked.example.org",),
                    mix=MixConfig(weights={str(paths[0]): anchor_weight}))
    failure = None
    try:
        run(config, out, engine=SerialEngine())
    except Exception as exc:  # what escaped is the finding
        failure = f"{type(exc).__name__}: {str(exc)[:500]}"
    funnel_path = out / "funnel.json"
    if not funnel_path.is_file():
        return Trial(survived=False, docs_lost=0, records_unread=0, failure=failure or "no funnel.json")
    accounting = json.loads(funnel_path.read_text())["accounting"]
    per_source = accounting["per_source"]
    docs_lost = sum(abs(b["unaccounted"]) for b in per_source.values())
    unread = sum(abs(f.records - per_source.get(str(p), {"in": 0})["in"])
                 for f, p in zip([anchor, *files], paths) if f.records is not None)
    kept = Counter(source for source, _ in {(d["source"], d["id"]) for d in _shard_docs(out)})
    wrong_kept = {s: (b["kept"], kept[s]) for s, b in per_source.items() if b["kept"] != kept[s]}
    if failure is None and (docs_lost or unread or wrong_kept or not accounting["balanced"]):
        failure = (f"accounting: {accounting['summary']}, docs_lost {docs_lost}, records_unread "
                   f"{unread}, kept (funnel, shards) {wrong_kept}")
    return Trial(survived=failure is None, docs_lost=docs_lost, records_unread=unread, failure=failure)


def _shard_docs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for part in sorted((out / "docs").glob("part-*.jsonl.gz"))
            for line in gzip.open(part, "rt", encoding="utf-8")]


def trial_files(rng: random.Random, texts: Sequence[str] = PROSE) -> list[FuzzFile]:
    """One to four files, each of a fault kind drawn from FAULTS."""
    return [FAULTS[rng.choice(sorted(FAULTS))](rng, texts) for _ in range(rng.randint(1, 4))]


def run_fuzz(trials: int, seed: int, workdir: Path) -> dict:
    """`trials` trials, each seeded by (seed, trial index); returns {"trials", "survived",
    "docs_lost" (in - kept - dropped - quarantined over every source and trial, in absolute
    value), "records_unread", "faults" (files per kind), "failures" (the first ten, with the
    trial index: its files stay in workdir/trial-NNNN for inspection)}."""
    workdir = Path(workdir)
    survived = docs_lost = unread = 0
    faults: Counter[str] = Counter()
    failures: list[str] = []
    for t in range(trials):
        rng = random.Random(f"{seed}:{t}")
        files = trial_files(rng)
        faults.update(f.kind for f in files)
        trial_dir = workdir / f"trial-{t:04d}"
        trial = run_trial(files, trial_dir, anchor_weight=rng.choice((1.0, 0.5, 2.0)))
        survived += trial.survived
        docs_lost += trial.docs_lost
        unread += trial.records_unread
        if trial.survived:
            shutil.rmtree(trial_dir, ignore_errors=True)
        elif len(failures) < 10:
            failures.append(f"trial {t} ({', '.join(f.name for f in files)}): {trial.failure}")
    return {"trials": trials, "survived": survived, "docs_lost": docs_lost,
            "records_unread": unread, "faults": dict(sorted(faults.items())), "failures": failures}
