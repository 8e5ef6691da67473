"""Near-dedup throughput and quality against datatrove and datasketch, on one labelled set.

    python -m bench dedup [--docs 2000] [--repeats 3] [--shared-data DIR] [--seeds 0,1,2,3]
                          [--bands 18 --rows 6 --band-layouts 2 --threshold 0.55]
                          (default: DedupConfig's) [--smoke]

The labelled set (tasks/collect/dedup/neardup_set.py): real documents of ../shared/data, ~15% of them with 1-3
edited copies, written once as a JSONL file in a temp dir. Every method reads that file and
finds near-duplicate clusters (reading the file is timed for all); timings are medians over
`--repeats` after one untimed warm-up on 100 documents, measured side by side in this process:

  ours        tasks/collect/dedup/near.py near_dedup (SerialEngine, one process), default DedupConfig
              (candidates from two band layouts of the same bands x rows values, each checked by
              exact Jaccard)
  datatrove   MinhashDedupSignature -> MinhashDedupBuckets -> MinhashDedupCluster ->
              MinhashDedupFilter, each on a LocalPipelineExecutor with one worker (tasks=1; the
              bucket step needs tasks = bands and runs them one after another). Same shingle
              size, bands, rows and seed as ours; its own normalization (spaCy words, numbers
              folded) and 64-bit xxhash. It keeps every candidate pair (no Jaccard check).
              (workers > 1 would need an `if __name__ == "__main__"` guard: bench/__main__.py
              has one.)
  datatrove (its default 14 x 8)  the same pipeline once more with datatrove's own banding, for
              precision and recall only (not timed)
  datasketch  MinHash.bulk over our shingles (num_perm = bands*rows), MinHashLSH with our
              threshold (it picks its own bands/rows for it); a document that queries any hit is
              a duplicate of the first hit, otherwise it is inserted (first occurrence wins).

Precision and recall are pairwise (two documents in one cluster = a predicted pair) against the
labels. Each seed of `--seeds` builds its own labelled set and gets its own table; the last line
is one JSON object with the headline figures: per seed, and docs/s as the median over seeds. The
exit status is 1 when ours has lower recall than datatrove at the same banding on any seed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import smoke
from bench.harness.runs import SHARED_DATA

COPIED_FRACTION = 0.15  # originals among the source documents
MEAN_COPIES = 1.7  # copies per original: 1, 2, 3 with weights 5, 3, 2 (tasks/collect/dedup/neardup_set.py)
WARMUP_DOCS = 100


def _read_jsonl(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def run_ours(path: Path, cfg) -> np.ndarray:
    from gristmill.core.stage import SerialEngine
    from gristmill.tasks.collect.dedup.near import near_dedup

    return near_dedup(_read_jsonl(path), cfg, SerialEngine()).cluster


def run_datasketch(path: Path, cfg) -> np.ndarray:
    from datasketch import MinHash, MinHashLSH

    from gristmill.tasks.collect.dedup.minhash import normalize

    k = cfg.shingle_words
    shingle_sets = []
    for text in _read_jsonl(path):
        words = normalize(text).split()
        grams = {" ".join(words[i:i + k]).encode() for i in range(max(len(words) - k + 1, 1))}
        shingle_sets.append(grams)
    minhashes = MinHash.bulk(shingle_sets, num_perm=cfg.num_perm, seed=cfg.seed)
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
    survivor = np.arange(len(minhashes))
    for i, m in enumerate(minhashes):
        hits = lsh.query(m)
        if hits:
            survivor[i] = min(hits)
        else:
            lsh.insert(i, m)
    return _labels_from_survivors(survivor)


def _labels_from_survivors(survivor: np.ndarray) -> np.ndarray:
    sizes = np.bincount(survivor, minlength=len(survivor))
    labels = np.where(sizes[survivor] >= 2, survivor, -1)
    return labels


def minhash_config(cfg, bands: int | None = None, rows: int | None = None):
    """datatrove's MinhashConfig for our DedupConfig `cfg`: same shingle size, banding (cfg's
    unless given) and seed, 64-bit xxhash."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    return MinhashConfig(n_grams=cfg.shingle_words, num_buckets=bands or cfg.bands,
                         hashes_per_bucket=rows or cfg.rows, seed=cfg.seed,
                         hash_config=HashConfig(precision=64, hash_fc="xxhash"))


def run_datatrove(path: Path, cfg, work: Path, stage_seconds: dict[str, list[float]],
                  bands: int | None = None, rows: int | None = None) -> np.ndarray:
    """Cluster labels from datatrove's four MinHash steps (banding: cfg's unless given)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader

    mh = minhash_config(cfg, bands, rows)
    sigs, buckets, clusters = work / "sigs", work / "buckets", work / "clusters"

    def reader() -> JsonlReader:
        return JsonlReader(str(path.parent), glob_pattern=path.name)

    stages = {
        "signature": ([reader(), MinhashDedupSignature(str(sigs), config=mh)], 1),
        "buckets": ([MinhashDedupBuckets(str(sigs), str(buckets), config=mh)], mh.num_buckets),
        "cluster": ([MinhashDedupCluster(str(buckets), str(clusters), config=mh,
                                         save_cluster_id=True)], 1),
        "filter": ([reader(), MinhashDedupFilter(str(clusters), load_cluster_ids=True)], 1),
    }
    # Each task logs to stderr (a sink added per task) and to its log file; stderr goes to
    # /dev/null so the table stays readable, the writes still happen.
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        for name, (pipeline, tasks) in stages.items():
            start = time.perf_counter()
            LocalPipelineExecutor(pipeline, tasks=tasks, workers=1,
                                  logging_dir=str(work / f"logs-{name}"), skip_completed=False).run()
            stage_seconds[name].append(time.perf_counter() - start)
    labels = np.full(len(_read_jsonl(path)), -1, np.int64)
    cluster_file = clusters / "000000.clusters"
    if cluster_file.exists():
        doc_cluster = np.fromfile(cluster_file, dtype="<u4").reshape(-1, 2).astype(np.int64)
        labels[doc_cluster[:, 0]] = doc_cluster[:, 1]
    return labels


def _write_jsonl(texts: list[str], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": str(i), "text": text}) + "\n" for i, text in enumerate(texts))


def _timed(fn: Callable[[int], np.ndarray], repeats: int) -> tuple[float, np.ndarray]:
    times, labels = [], None
    for r in range(repeats):
        start = time.perf_counter()
        labels = fn(r)
        times.append(time.perf_counter() - start)
    return statistics.median(times), labels


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench dedup", description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=2000, help="documents in the labelled set")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                        help="seeds of the labelled sets, comma-separated")
    parser.add_argument("--shared-data", type=Path, default=SHARED_DATA)
    for name in ("bands", "rows", "band_layouts", "threshold"):
        parser.add_argument(f"--{name.replace('_', '-')}",
                            type=float if name == "threshold" else int,
                            help="DedupConfig field for ours and the peers (default: its default)")
    return smoke.parse(parser, argv, docs=200, repeats=1)


def _measure(texts: list[str], truth: set[tuple[int, int]], cfg, repeats: int, root: Path):
    """{method: (median seconds or None, precision, recall)}, datatrove's per-step seconds."""
    from gristmill.tasks.collect.dedup.neardup_set import precision_recall

    data, warm = root / "data" / "docs.jsonl", root / "warm" / "docs.jsonl"
    for path, docs in ((data, texts), (warm, texts[:WARMUP_DOCS])):
        path.parent.mkdir()
        _write_jsonl(docs, path)
    steps: dict[str, list[float]] = defaultdict(list)
    methods = {
        "ours": lambda p, r: run_ours(p, cfg),
        "datatrove": lambda p, r: run_datatrove(p, cfg, root / f"dt-{p.parent.name}-{r}", steps),
        "datasketch": lambda p, r: run_datasketch(p, cfg),
    }
    results = {}
    for name, method in methods.items():
        method(warm, 0)
        seconds, labels = _timed(lambda r, method=method: method(data, r), repeats)
        results[name] = (seconds, *precision_recall(labels, truth))
    default_labels = run_datatrove(data, cfg, root / "dt-default", defaultdict(list), 14, 8)
    results["datatrove 14x8"] = (None, *precision_recall(default_labels, truth))
    return results, {k: v[1:] for k, v in steps.items()}  # minus the warm-up


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from gristmill.tasks.collect.dedup.config import DedupConfig
    from gristmill.tasks.collect.dedup.neardup_set import build_labelled_set, pair_jaccards

    cfg = DedupConfig(**{k: getattr(args, k) for k in ("bands", "rows", "band_layouts", "threshold")
                         if getattr(args, k) is not None})
    n_originals = round(args.docs * COPIED_FRACTION / (1 + COPIED_FRACTION * MEAN_COPIES))
    n_distinct = max(0, args.docs - round(n_originals * (1 + MEAN_COPIES)))
    per_seed = {}
    for seed in args.seeds:
        texts, truth = build_labelled_set(args.shared_data, n_originals, seed, n_distinct)
        with tempfile.TemporaryDirectory(prefix="bench-dedup-") as tmp:
            results, steps = _measure(texts, truth, cfg, args.repeats, Path(tmp))
        per_seed[seed] = _report(seed, args, cfg, texts, truth, pair_jaccards(texts, truth, cfg),
                                 results, steps)
    return _summary(args, cfg, per_seed)


def _report(seed, args, cfg, texts, truth, jaccards, results, stage_seconds) -> dict:
    """Print one seed's table; its figures for the summary."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
    print(f"seed {seed}: {len(texts)} docs, {len(truth)} labelled pairs (exact Jaccard of "
          f"{cfg.shingle_words}-word shingles: median {np.median(jaccards):.2f}, "
          f"{np.mean(jaccards >= cfg.threshold):.0%} >= {cfg.threshold}), bands x rows = "
          f"{cfg.bands} x {cfg.rows}, {cfg.band_layouts} band layout(s), threshold "
          f"{cfg.threshold}; datasketch chose {lsh.b} x {lsh.r}; median of {args.repeats}")
    print(f"{'method':<16}{'seconds':>10}{'docs/s':>10}{'precision':>11}{'recall':>9}")
    for name, (seconds, precision, recall) in results.items():
        timing = (f"{seconds:>10.3f}{len(texts) / seconds:>10.0f}" if seconds
                  else f"{'(untimed)':>20}")
        print(f"{name:<16}{timing}{precision:>11.4f}{recall:>9.4f}")
    print("datatrove steps (median s): " + ", ".join(
        f"{name} {statistics.median(v):.3f}" for name, v in stage_seconds.items()))
    figures = {"docs": len(texts), "labelled_pairs": len(truth)}
    for name, (seconds, precision, recall) in results.items():
        key = name.replace(" ", "_")
        if seconds:
            figures[f"{key}_docs_s"] = round(len(texts) / seconds, 1)
        figures[f"{key}_precision"], figures[f"{key}_recall"] = round(precision, 4), round(recall, 4)
    return figures


def _summary(args, cfg, per_seed: dict[int, dict]) -> int:
    """The JSON line: per-seed figures, medians over seeds; 1 if ours trails datatrove's
    recall (same banding) on any seed."""
    docs_s = {name: statistics.median(f[f"{name}_docs_s"] for f in per_seed.values())
              for name in ("ours", "datatrove", "datasketch")}
    behind = [seed for seed, f in per_seed.items() if f["ours_recall"] < f["datatrove_recall"]]
    print(json.dumps({
        "bench": "dedup", "seeds": args.seeds, "repeats": args.repeats, "bands": cfg.bands,
        "rows": cfg.rows, "band_layouts": cfg.band_layouts, "threshold": cfg.threshold,
        **{f"{k}_docs_s": round(v, 1) for k, v in docs_s.items()},
        "ratio_vs_datatrove": round(docs_s["ours"] / docs_s["datatrove"], 3),
        "ratio_vs_datasketch": round(docs_s["ours"] / docs_s["datasketch"], 3),
        "min_precision": min(f["ours_precision"] for f in per_seed.values()),
        "recall_ge_datatrove_every_seed": not behind,
        "per_seed": per_seed}))
    if behind:
        print(f"ours has lower recall than datatrove on seed(s) {behind}", file=sys.stderr)
    return 1 if behind else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
