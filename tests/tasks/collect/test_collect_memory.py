"""The collect stage's own process holds no corpus-sized state: merging, deduplicating, mixing
and writing four times as many documents costs it no more memory than a quarter of them does,
but for ~2 KB of references, hashes and signatures per document."""
from __future__ import annotations

import multiprocessing
import shutil
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from collect_helpers import spooled_table

import gristmill.tasks.collect.stage as collect
from gristmill.core.stage import SerialEngine

SPEECHES = ("corpus/nltk_inaugural", "corpus/nltk_state_union")  # 124 addresses, 2.9 MB
# Measured: the 4x run's traced peak exceeds the 1x run's by 0.05 MB (2.31 -> 2.36 MB); before
# the corpus-level steps streamed, by 9.9 MB (5.7 -> 15.6 MB). Holding the 3x more texts alone
# would add 2.2 MB.
MARGIN_BYTES = 1_000_000


class WorkerProcess:
    """An engine with one worker process, as the stage's Ray workers are: the tasks it maps
    (near dedup's signatures and checks) allocate there, not in the measured process."""

    def __init__(self):
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
        self.pool.submit(int).result()  # forked now, before anything is traced

    def map(self, fn, items):
        return list(self.pool.map(fn, items))


def _traced_peak(config: collect.Config, out: Path, engine: WorkerProcess) -> tuple[int, dict]:
    """Peak bytes the stage allocates in this process (tracemalloc) once its work units are done:
    what the corpus-level steps hold."""
    tracemalloc.start()
    try:
        result = collect.run(config, out, engine=engine)
        return tracemalloc.get_traced_memory()[1], result.stats
    finally:
        tracemalloc.stop()


@pytest.mark.slow  # 20-30 s: cleaning the 124 speeches once
def test_driver_memory_does_not_grow_with_the_corpus(shared_data, tmp_path):
    files = sorted(p for d in SPEECHES for p in (shared_data / d).glob("*.txt"))
    ordered = files[::4] + [f for i, f in enumerate(files) if i % 4]  # 1x: every fourth speech
    quarter = len(files[::4])
    configs = {n: collect.Config(sources=[str(f) for f in ordered[:n]])
               for n in (quarter, len(ordered))}
    big, small = tmp_path / "4x", tmp_path / "1x"
    engine = WorkerProcess()
    try:
        units = collect.plan_units(configs[len(ordered)], big / collect.DOWNLOADS_DIR)
        collect.run_units(units, big / collect.UNITS_DIR, SerialEngine())  # cleaning: not measured
        shutil.copytree(big / collect.UNITS_DIR, small / collect.UNITS_DIR)  # the 1x plan's units
        peak_1x, stats_1x = _traced_peak(configs[quarter], small, engine)
        peak_4x, stats_4x = _traced_peak(configs[len(ordered)], big, engine)
    finally:
        engine.pool.shutdown()
    assert stats_4x["docs_out"] >= 3.5 * stats_1x["docs_out"] > 0  # four times the documents
    assert stats_4x["bytes_out"] >= 3 * stats_1x["bytes_out"]  # 3.5x measured
    assert peak_4x - peak_1x <= MARGIN_BYTES, (peak_1x, peak_4x)


def test_near_dedup_holds_no_signatures_in_the_driver(tmp_path):
    """Near dedup's signatures (432 bytes a document) and bucket keys (288) stay on the workers
    and in spilled files; the driver holds a flag a document, the candidate pairs and the lazy
    views of the spooled texts it hands out: its peak is under 100 bytes a document (measured 67;
    it was 1,070 when the driver gathered the signatures, 2.7 KB before that)."""
    import random

    from gristmill.tasks.collect.dedup.config import DedupConfig
    from gristmill.tasks.collect.dedup.near import near_dedup

    n, cfg = 30_000, DedupConfig(chunk_docs=128)  # 235 chunks
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(5000)]
    texts = [" ".join(rng.choices(vocab, k=150)) for _ in range(n)]
    for i in range(0, n, 10):
        texts[i + 1] = texts[i] + " and one more word"  # a near-duplicate family every ten
    refs = spooled_table(tmp_path / "kept.jsonl", texts)  # as the stage hands them over: spooled
    del texts
    ids = list(refs.ids)
    one_copy = n * (cfg.num_perm * 4 + cfg.bands * cfg.band_layouts * 8)
    engine = WorkerProcess()
    np.unique(np.arange(3))  # its first call imports ~10 MB of numpy once, whatever the corpus
    tracemalloc.start()
    try:
        result = near_dedup(refs.texts(), cfg, engine, ids=ids, index_dir=tmp_path / "index")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        engine.pool.shutdown()
    assert result.near_duplicates == n // 10 and len(result.index) == n - n // 10
    assert peak < 100 * n < one_copy / 7, (peak / n, one_copy / n)
