"""The scale benchmark's runs (bench/scale.py), one system at a time: `gristmill run` over a corpus
(`run_ours`), datatrove's equivalent pipeline in a process of its own (`run_peer`,
`datatrove_child`), and the same work units in bare processes (`units_ceiling`, `units_child`),
each timed with its process tree sampled for memory and CPU (`TreePeaks`), and near-dup
precision and recall against the planted families. bench/scale.py decides which runs to make
and reports them.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.harness.runs import REPO, cli_env, committed_dir
from bench.scale_corpus import Corpus

REVIEW_ALL = 10**9  # collect.review_samples for the labelled run: every drop with its reason
SAMPLE_S = 0.2
MB = 1024 * 1024


# ---------------------------------------------------------------- measuring a process tree

def _vm_hwm(pid: int) -> int:
    """The process's RSS high-water mark (VmHWM), bytes; 0 when it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class TreePeaks:
    """`with TreePeaks(pid) as peaks: ...`: each process's peak RSS (VmHWM) in the tree under pid,
    and the peak of the tree's summed RSS, sampled every SAMPLE_S."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak: dict[int, int] = {}
        self.workers: set[int] = set()  # pids seen as Ray's `_Worker` actors
        self.worker_cpu: dict[int, float] = {}  # their user + system seconds, as last sampled
        self.driver = pid  # `gristmill run` supervises a child that runs the flow: that one
        self.tree_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:  # the root has exited
            return
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
                self.peak[proc.pid] = max(self.peak.get(proc.pid, 0), _vm_hwm(proc.pid))
                if proc.pid in self.workers:
                    cpu = proc.cpu_times()
                    self.worker_cpu[proc.pid] = cpu.user + cpu.system
                if proc.pid not in self.workers and proc.pid != self.driver:
                    cmdline = " ".join(proc.cmdline())
                    if "ray::_Worker" in cmdline:
                        self.workers.add(proc.pid)
                    elif "gristmill.flows.supervised" in cmdline:
                        self.driver = proc.pid
        self.tree_peak = max(self.tree_peak, total)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def __enter__(self) -> TreePeaks:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def figures(self) -> dict[str, Any]:
        return {"driver_peak_mb": round(self.peak.get(self.driver, 0) / MB, 1),
                "worker_peak_mb": sorted(round(self.peak[p] / MB, 1) for p in self.workers),
                "tree_peak_mb": round(self.tree_peak / MB, 1),
                "worker_cpu_s": round(sum(self.worker_cpu.values()), 1)}


def run_tree(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, TreePeaks]:
    """Run cmd (output to log), timing it and sampling its tree; RuntimeError when it fails."""
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        with TreePeaks(proc.pid) as peaks:
            proc.wait()
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n"
                           f"{log.read_text(errors='replace')[-4000:]}")
    return seconds, peaks


def _read_jsonl_gz(paths) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(paths):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows += [json.loads(line) for line in f]
    return rows


def _labels(corpus: Corpus, clusters: dict[Any, list[str]]) -> np.ndarray:
    """Cluster label per document index (-1: none) from cluster -> member URLs."""
    index, labels = corpus.index(), np.full(len(corpus.urls), -1, np.int64)
    for label, urls in enumerate(clusters.values()):
        labels[[index[u] for u in urls]] = label
    return labels


def near_dup_quality(corpus: Corpus, labels: np.ndarray, reached: set[str]) -> dict[str, Any]:
    """Pairwise precision and recall on the planted pairs whose documents both reached near
    dedup (URLs in `reached`)."""
    from gristmill.tasks.collect.dedup.neardup_set import precision_recall

    at = {corpus.index()[u] for u in reached}
    truth = {(a, b) for a, b in corpus.truth if a in at and b in at}
    precision, recall = precision_recall(labels, truth)
    return {"precision": round(precision, 4), "recall": round(recall, 4), "pairs": len(truth),
            "planted_pairs": len(corpus.truth)}


# ---------------------------------------------------------------- ours: the CLI

def run_ours(corpus: Corpus, workers: int, home: Path, labelled: bool = False) -> dict[str, Any]:
    overrides = [f"collect.sources={json.dumps(corpus.sources)}", f"collect.num_workers={workers}"]
    if labelled:
        overrides.append(f"collect.review_samples={REVIEW_ALL}")
    cmd = [sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *overrides,
           "--until", "collect"]
    home.mkdir(parents=True)
    seconds, peaks = run_tree(cmd, home.parent / f"{home.name}.log", cli_env(home))
    out = committed_dir(home, "collect")
    funnel = json.loads((out / "funnel.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    stage_s, stats = manifest["meta"]["seconds"], manifest["stats"]
    cold_start = sum(v for k, v in stats.items() if k.startswith("cold_start_s_"))
    kept = _read_jsonl_gz(out.glob("docs/part-*.jsonl.gz"))
    kept_urls = {d["url"] for d in kept}
    run = {"system": "ours", "docs": len(corpus.urls), "workers": workers, "seconds": seconds,
           "stage_s": stage_s,
           **peaks.figures(), "kept": len(kept_urls),
           "junk_kept": sum(corpus.urls[i] in kept_urls for i in corpus.junk),
           "disk_mb": round(sum(p.stat().st_size for p in (home / "artifacts").rglob("*")
                                if p.is_file()) / MB, 1),
           # its workers' loading before their first record (datatrove's is inside its blocks' seconds)
           "steps_s": {"cold_start": round(cold_start * stats["cold_start_processes"], 3),
                       **{k.removeprefix("step_s_"): v for k, v in stats.items() if k.startswith("step_s_")}},
           "cold_start_s": round(cold_start, 3),  # the mean worker's (bench worker-start has each part)
           "accounting_balanced": funnel["accounting"]["balanced"],
           "accounting": funnel["accounting"]["summary"],
           "near_duplicates": funnel["near_duplicates"]}
    if labelled:
        by_id = {d["id"]: d["url"] for d in kept}
        clusters: dict[str, list[str]] = {}
        dropped = [json.loads(line) for line in (out / "review" / "dropped.jsonl").open()]
        for row in dropped:
            if row["reason"] == "near_duplicates":
                survivor = by_id[row["duplicate_of"]]
                clusters.setdefault(survivor, [survivor]).append(row["url"])
        reached = kept_urls | {r["url"] for r in dropped if r["reason"] == "near_duplicates"}
        run["quality"] = near_dup_quality(corpus, _labels(corpus, clusters), reached)
    return run


# ---------------------------------------------------------------- datatrove, in a process of its own

# datatrove's blocks of the cleaning executor, by class, as the collect stage's steps (timing.py)
DATATROVE_STEPS = {"WarcReader": "read_extract", "Trafilatura": "read_extract", "JsonlReader": "read_extract",
                   "LambdaFilter": "url_filter", "LanguageFilter": "language_id",
                   "GopherQualityFilter": "quality_filters", "GopherRepetitionFilter": "quality_filters",
                   "FineWebQualityFilter": "quality_filters", "C4QualityFilter": "quality_filters",
                   "PIIFormatter": "pii", "JsonlWriter": "write", "MinhashDedupSignature": "minhash_signatures"}


def datatrove_steps(pipeline: list[Any], stats_json: Path) -> dict[str, float]:
    """The seconds datatrove's own counters give each block of `pipeline` (summed over its tasks,
    from the executor's stats.json, one entry per block in order), summed by our step. The MinHash
    signature block, last, times its whole loop over the stream, the blocks before it included:
    its own seconds are its total less theirs."""
    blocks = json.loads(stats_json.read_text())
    assert len(blocks) == len(pipeline) and type(pipeline[-1]).__name__ == "MinhashDedupSignature"
    totals = [entry["time_stats"]["total"] if entry["time_stats"] else 0.0 for entry in blocks]
    totals[-1] -= sum(totals[:-1])
    steps: dict[str, float] = {}
    for block, total in zip(pipeline, totals):
        step = DATATROVE_STEPS[type(block).__name__]
        steps[step] = round(steps.get(step, 0.0) + total, 6)
    return steps


def datatrove_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run datatrove's pipeline (bench/scale.py's docstring); seconds per executor run, and the
    cleaning executor's per block, by our step."""
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.readers import JsonlReader, WarcReader
    from datatrove.pipeline.writers import JsonlWriter

    from bench.clean import datatrove_filters, run_datatrove
    from bench.dedup import minhash_config
    from bench.memory import _tiny_collect

    cfg, work, workers = _tiny_collect(), Path(spec["work"]), spec["workers"]
    mh = minhash_config(cfg.dedup)
    cleaned, sigs, buckets, clusters = (str(work / d) for d in ("cleaned", "sigs", "buckets", "clusters"))
    steps = {
        "clean+signature": ([WarcReader(spec["warc"]),
                             Trafilatura(favour_precision=True, deduplicate=False, include_tables=False),
                             JsonlReader(spec["jsonl"]), *datatrove_filters(cfg),
                             JsonlWriter(cleaned), MinhashDedupSignature(sigs, config=mh)], workers),
        "buckets": ([MinhashDedupBuckets(sigs, buckets, config=mh)], mh.num_buckets),
        "cluster": ([MinhashDedupCluster(buckets, clusters, config=mh, save_cluster_id=True)], 1),
        "filter": ([JsonlReader(cleaned),
                    MinhashDedupFilter(clusters, exclusion_writer=JsonlWriter(str(work / "removed")),
                                       load_cluster_ids=True),
                    JsonlWriter(str(work / "out"))], workers),
    }
    seconds: dict[str, Any] = {}
    for name, (pipeline, tasks) in steps.items():
        start = time.perf_counter()
        run_datatrove(pipeline, work / f"logs-{name}", tasks=tasks, workers=min(tasks, workers))
        seconds[name] = round(time.perf_counter() - start, 2)
    cleaning = steps["clean+signature"][0]
    seconds["blocks"] = datatrove_steps(cleaning, work / "logs-clean+signature" / "stats.json")
    return seconds


def run_peer(corpus: Corpus, workers: int, work: Path) -> dict[str, Any]:
    spec = {"warc": corpus.sources[0], "jsonl": corpus.sources[1], "work": str(work),
            "workers": workers}
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "bench.scale", "--datatrove-child", json.dumps(spec)]
    seconds, peaks = run_tree(cmd, work.parent / f"{work.name}.log")
    steps = json.loads((work.parent / f"{work.name}.log").read_text().strip().splitlines()[-1])
    blocks = steps.pop("blocks")
    cleaned = {d["metadata"]["url"] for d in _read_jsonl_gz(work.glob("cleaned/*.jsonl.gz"))}
    out = _read_jsonl_gz(work.glob("out/*.jsonl.gz"))
    removed = _read_jsonl_gz(work.glob("removed/*.jsonl.gz"))
    clusters: dict[int, list[str]] = {}
    for d in out + removed:
        if d["metadata"].get("minhash_cluster_id", -1) >= 0:
            clusters.setdefault(d["metadata"]["minhash_cluster_id"], []).append(d["metadata"]["url"])
    figures = peaks.figures()
    return {"system": "datatrove", "docs": len(corpus.urls), "workers": workers, "seconds": seconds,
            "tree_peak_mb": figures["tree_peak_mb"], "kept": len(out),
            "junk_kept": sum(corpus.urls[i] in cleaned for i in corpus.junk),
            "disk_mb": round(sum(p.stat().st_size for p in work.rglob("*") if p.is_file()) / MB, 1),
            "near_duplicates": len(removed), "executors_s": steps,
            # the stage's steps: the cleaning blocks' own seconds, near dedup the later executors' walls
            "steps_s": {**blocks, "near_dedup": round(steps["buckets"] + steps["cluster"] + steps["filter"], 2)},
            "quality": near_dup_quality(corpus, _labels(corpus, clusters), cleaned)}


# ---------------------------------------------------------------- the machine's own 1 -> 2

CEILING_UNITS = 6  # of each kind (WARC, JSONL) a ceiling child times, after one to warm up


def units_child(spec: dict[str, Any]) -> dict[str, float]:
    """Wall and CPU seconds for one bare process (no Ray, no services) to run the collect stage's
    own `process_unit` over CEILING_UNITS WARC and JSONL units of the corpus each, after a first
    unit that loads the models."""
    from bench.memory import _tiny_collect
    from gristmill.tasks.collect.stage import plan_units, process_unit, unit_result_path

    cfg = _tiny_collect().model_copy(update={"sources": spec["sources"]})
    out = Path(spec["work"])
    units = plan_units(cfg, out)
    by_kind = [[u for u in units if u.source == source] for source in spec["sources"]]
    warm_up, timed = by_kind[0][0], [u for kind in by_kind for u in kind[1:1 + CEILING_UNITS]]
    process_unit((warm_up, str(unit_result_path(out, warm_up))))
    start, cpu = time.perf_counter(), time.process_time()
    for unit in timed:
        process_unit((unit, str(unit_result_path(out, unit))))
    return {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}


def units_ceiling(corpus: Corpus, rounds: int, work: Path) -> tuple[float, float]:
    """How much more of the same work two bare processes get done at once than one alone on this
    machine, now: what 1 -> 2 workers could reach if nothing but the units ran; and how much more
    CPU time the same units take in each of the two than alone (medians over `rounds`, each one
    alone then two at once)."""
    def children(count: int, tag: str) -> list[dict[str, float]]:
        procs = []
        for i in range(count):
            (child := work / f"ceiling-{tag}-{i}").mkdir(parents=True)
            spec = {"sources": corpus.sources, "work": str(child)}
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.scale", "--units-child",
                                           json.dumps(spec)], cwd=REPO, stdout=subprocess.PIPE, text=True))
        return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]

    ratios, inflations = [], []
    for r in range(rounds):
        [alone], pair = children(1, f"{r}-alone"), children(2, f"{r}-pair")
        ratios.append(2 * alone["seconds"] / max(p["seconds"] for p in pair))
        inflations.append(statistics.mean(p["cpu_s"] for p in pair) / alone["cpu_s"])
        _log(f"units ceiling round {r}: one alone {alone['seconds']:.1f} s ({alone['cpu_s']:.1f} CPU-s), "
             f"two at once {pair[0]['seconds']:.1f} / {pair[1]['seconds']:.1f} s "
             f"({pair[0]['cpu_s']:.1f} / {pair[1]['cpu_s']:.1f} CPU-s) -> {ratios[-1]:.3f}, "
             f"CPU x{inflations[-1]:.3f}")
    shutil.rmtree(work)
    return statistics.median(ratios), statistics.median(inflations)


def _log(item: Any) -> None:
    print(f"  {item}", file=sys.stderr, flush=True)
