"""Memory of the collect stage against corpus size: the tiny preset's collect config on the demo
corpus (1x) and on four times as many distinct documents (4x).

    python -m bench memory [--repeats 3] [--workers 2] [--max-docs-per-source N] [--smoke]

Corpora. 1x: the tiny preset's collect config as it is (`demo:python-docs`). 4x: the same config
with three more sources, JSONL files of spliced copies of the demo's documents (their extracted
text, read once before any measurement): copy k (1-3) of document i is the first half of its
lines followed by the second half of the lines of document (i + k*n/4) mod n, so every copy is
real package documentation, distinct from every other document (exact dedup keeps it) and shares
about a third of its shingles with its two parents (near dedup, at Jaccard 0.55, keeps most of
them; the table says how many it removed). `--max-docs-per-source N` reads at most N documents of
each source (`collect.max_docs_per_source`), so 4x stays four times 1x.

Each run is a fresh process (`--child`) that runs `gristmill.tasks.collect.stage.run` as the pipeline does:
on RayEngine(--workers) inside infra.memory.PeakRSS, whose figure the pipeline records as the
stage's `peak_rss_mb` (this process and every process it started: the local Ray's services and
workers). Driver growth, what the stage's own process holds for the corpus: `driver_rss` is the
process's RSS high-water mark (ru_maxrss) minus its RSS just before the run; `driver_traced` is
tracemalloc's peak (Python objects and numpy arrays) over the run, measured in a second run of
its own because tracing costs time and memory. Figures are medians over --repeats; the last line
is one JSON object with `collect_peak_rss_mb_1x`, `collect_peak_rss_mb_4x` and their ratio.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import smoke

REPO = Path(__file__).resolve().parents[1]
SCALES = (1, 4)
MB = 1024 * 1024


def _tiny_collect():
    from gristmill.flows.config import load_config

    return load_config(REPO / "configs" / "tiny.yaml").collect


def demo_texts() -> list[tuple[str, str]]:
    """(url, extracted text) of every demo document, in the demo crawl's order."""
    from gristmill.tasks.collect.read import demo_crawl
    from gristmill.tasks.collect.read.readers import RawDoc, extract_text

    docs = []
    for record in demo_crawl.iter_records(demo_crawl.list_packages()):
        if isinstance(record, RawDoc) and (text := extract_text(record)):
            docs.append((record.url, text))
    return docs


def splice(docs: list[tuple[str, str]], k: int) -> list[dict[str, str]]:
    """Copy k of the corpus: each document's first half of lines, then the second half of the
    document k*n/4 places on (see the module docstring)."""
    n = len(docs)
    out = []
    for i, (url, text) in enumerate(docs):
        head = text.splitlines(keepends=True)
        tail = docs[(i + k * n // 4) % n][1].splitlines(keepends=True)
        out.append({"url": f"{url}#splice-{k}",
                    "text": "".join(head[:len(head) // 2] + tail[len(tail) // 2:])})
    return out


def write_sources(root: Path) -> dict[int, list[str]]:
    """Sources of each scale: the demo, and for 4x three JSONL files of spliced copies."""
    docs = demo_texts()
    extra = []
    for k in range(1, 4):
        path = root / f"splice-{k}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in splice(docs, k))
        extra.append(str(path))
    demo = list(_tiny_collect().sources)
    return {1: demo, 4: demo + extra}


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One collect run as the pipeline runs it; its figures."""
    import tracemalloc

    import gristmill.tasks.collect.stage as collect
    from gristmill.infra.memory import PeakRSS
    from gristmill.infra.ray_engine import RayEngine

    config = collect.Config.model_validate({**_tiny_collect().model_dump(), "sources": spec["sources"],
                                            "num_workers": spec["workers"],
                                            "max_docs_per_source": spec["max_docs_per_source"]})
    out = Path(spec["out"])
    out.mkdir(parents=True)
    before = _rss_bytes()
    if spec["trace"]:
        tracemalloc.start()
    started = time.perf_counter()
    with PeakRSS() as peak:  # as flows/pipeline.py measures a stage
        engine = RayEngine(num_workers=config.num_workers)
        try:
            result = collect.run(config, out, engine=engine)
        finally:
            engine.shutdown()
    seconds = time.perf_counter() - started
    traced = tracemalloc.get_traced_memory()[1] if spec["trace"] else None
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    stats = result.stats
    return {"tree_peak_mb": peak.mb, "driver_rss_mb": round((high_water - before) / MB, 1),
            "driver_traced_mb": None if traced is None else round(traced / MB, 2),
            "seconds": round(seconds, 1), "docs_in": stats["docs_in"],
            "after_exact_dedup": stats["docs_after_exact_dedup"],
            "near_duplicates": stats.get("near_dedup_near_duplicates", 0),
            "docs_out": stats["docs_out"], "bytes_out": stats["bytes_out"]}


def _run_child(sources: list[str], workers: int, trace: bool, work: Path,
               max_docs_per_source: int | None = None) -> dict[str, Any]:
    out = work / "out"
    spec = {"sources": sources, "workers": workers, "trace": trace, "out": str(out),
            "max_docs_per_source": max_docs_per_source}
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.memory", "--child", json.dumps(spec)],
                              cwd=REPO, capture_output=True, text=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"collect run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in runs if r[key] is not None), 2)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench memory",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=_tiny_collect().num_workers)
    parser.add_argument("--max-docs-per-source", type=int, help="documents read of each source (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = smoke.parse(parser, argv, repeats=1, workers=1, max_docs_per_source=30)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        work = Path(tmp)
        sources = write_sources(work)
        runs: dict[int, list[dict[str, Any]]] = {scale: [] for scale in SCALES}
        for repeat in range(args.repeats):
            for scale in SCALES:  # interleaved, so a busier moment of the machine hits both
                for trace in (False, True):
                    runs[scale].append(_run_child(sources[scale], args.workers, trace, work,
                                                  args.max_docs_per_source))
                    print(f"repeat {repeat} {scale}x trace={trace}: {runs[scale][-1]}",
                          file=sys.stderr, flush=True)
    print(f"{'corpus':>6} {'docs in':>8} {'exact-dedup':>11} {'near-dups':>9} {'docs out':>8} "
          f"{'MB out':>7} {'tree peak MB':>12} {'driver RSS +MB':>14} {'driver traced MB':>16} "
          f"{'s':>6}")
    summary = {}
    for scale, scale_runs in runs.items():
        first = scale_runs[0]
        row = {key: _median(scale_runs, key) for key in
               ("tree_peak_mb", "driver_rss_mb", "driver_traced_mb", "seconds")}
        plain = [r for r in scale_runs if r["driver_traced_mb"] is None]
        row["tree_peak_mb"] = _median(plain, "tree_peak_mb")  # tracing inflates the driver
        row["driver_rss_mb"] = _median(plain, "driver_rss_mb")
        row["seconds"] = _median(plain, "seconds")
        print(f"{f'{scale}x':>6} {first['docs_in']:>8} {first['after_exact_dedup']:>11} "
              f"{first['near_duplicates']:>9} {first['docs_out']:>8} "
              f"{first['bytes_out'] / 1e6:>7.2f} {row['tree_peak_mb']:>12.0f} "
              f"{row['driver_rss_mb']:>14.1f} {row['driver_traced_mb']:>16.2f} "
              f"{row['seconds']:>6.1f}")
        summary[scale] = row
    one, four = summary[1], summary[4]
    print(json.dumps({
        "collect_peak_rss_mb_1x": one["tree_peak_mb"], "collect_peak_rss_mb_4x": four["tree_peak_mb"],
        "peak_rss_ratio_4x_vs_1x": round(four["tree_peak_mb"] / one["tree_peak_mb"], 3),
        "driver_rss_growth_mb_1x": one["driver_rss_mb"], "driver_rss_growth_mb_4x": four["driver_rss_mb"],
        "driver_traced_peak_mb_1x": one["driver_traced_mb"],
        "driver_traced_peak_mb_4x": four["driver_traced_mb"],
        "repeats": args.repeats, "workers": args.workers}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
