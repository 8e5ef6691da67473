"""The collect stage at scale: the real CLI over a web-like corpus of N documents, against
datatrove's equivalent pipeline on the same files, and from 1 to 2 workers.

    python -m bench scale --docs 10000,30000,100000 [--workers 1,2] [--sweep-docs 10000,30000]
                          [--datatrove-docs 10000] [--repeats 1] [--seed 0] [--keep DIR]

Corpus (one per N and seed, written to a temp dir, or under --keep): every document is distinct,
made of whole paragraphs of the English text of ../shared/data (tasks/collect/dedup/neardup_set.py's
paragraphs, those fastText reads as English at >= 0.8), recombined with a seeded RNG: 200-450
words, no paragraph over 35% of its document, and no two documents share more than one
paragraph (so two unplanted documents have a 5-word-shingle Jaccard of about 0.2 at most).
8% of the documents are originals of a planted near-duplicate family: 1-3 copies each with
neardup_set's edits (site header/footer, paragraphs shuffled or dropped, typos). 6% are junk
the filters must drop, in turn: foreign (10-16 lingua sentences of one non-English language),
short (15-35 words of a paragraph), spam (a line repeated 12-25 times above a paragraph) and
lorem (a document with a lorem-ipsum paragraph). Half the documents, at random, are HTML pages
(a nav bar, an article, a footer) in WARC response records (warc/part-*.warc.gz), the rest
dolma-style JSON lines (jsonl/part-*.jsonl.gz), 500 documents a file, so both systems get many
files to share out. Bad input beside the N documents: each JSONL file has a line that is not JSON
and a record without text, each WARC file an image response.

  ours       `gristmill run configs/tiny.yaml collect.sources=[warc dir, jsonl dir]
             collect.num_workers=W --until collect` in a fresh GRISTMILL_HOME (a new process:
             Ray, spaCy and fastText start cold); wall seconds of the whole command, and the
             stage's own seconds from its manifest (from planning the units to the committed
             output: Ray's start-up is in it, the CLI's imports and the embedded Prefect server
             are not). The stage records sampled RSS peaks (`peak_rss_mb`, `driver_peak_rss_mb`,
             `worker_peak_rss_mb`), which miss a spike between samples, so this benchmark samples
             the process tree every 0.2 s too: each process's VmHWM (the kernel's
             RSS high-water mark, so a peak between samples is not missed, only growth in a
             process's last 0.2 s) for the driver (`python -m flows.supervised`, the child of
             `gristmill run` that runs the flow and the stage) and each Ray worker
             (`ray::_Worker` processes), and the sum of RSS over the tree; and the workers'
             CPU seconds (user + system, as last sampled: `worker_cpu_s`). Disk written: bytes
             under the home's artifacts/ after the run. Accounting: funnel.json's `accounting`
             must balance (the benchmark fails otherwise).
  datatrove  one fresh process (`--datatrove-child`, cold too), LocalPipelineExecutor with
             tasks = workers = W: WarcReader -> Trafilatura (favour_precision, no dedup, no
             tables, as ours) -> JsonlReader (its documents join after the extractor) -> the
             filters exactly as bench/clean.py builds them (URL rule, LanguageFilter on the
             bundled lid.176, GopherQuality, GopherRepetition, FineWebQuality, C4Quality with our
             constructor arguments) -> PIIFormatter -> JsonlWriter (the cleaned documents) ->
             MinhashDedupSignature; then MinhashDedupBuckets (tasks = bands), MinhashDedupCluster,
             and JsonlReader -> MinhashDedupFilter (removed documents to an exclusion JsonlWriter)
             -> JsonlWriter. Its MinHash settings are ours (bench/dedup.py's minhash_config:
             18 x 6, 5-word shingles). It has no exact dedup and no ftfy; ours has both.

Near-dup quality: the stage records each removed near-duplicate's survivor (`duplicate_of`) only
in review/dropped.jsonl, which keeps `review_samples` (20) rows per reason, held in the driver
until the end. So at each --datatrove-docs size one more, untimed run of ours (the largest
worker count) sets collect.review_samples=10**9, and its clusters (survivor + removed) give
pairwise precision and recall (neardup_set.precision_recall) against the planted families;
datatrove's come from `minhash_cluster_id` of its kept and removed documents. Recall counts the
planted pairs whose two documents reached near dedup in that system (passed its filters; ours:
and exact dedup); `pairs` says how many.

Which runs: at each --sweep-docs size (default: every N) ours runs at every --workers count, at
the other sizes at the largest count only; at each --datatrove-docs size datatrove runs beside
ours at every count. With --repeats > 1 each (system, N, W) runs that many times, interleaved,
and figures are medians. docs/s counts the N input documents, MB/s the corpus files' bytes on
disk (gzip). Fits, per worker count over the sizes it ran at (headline: the largest count, which
runs at every N): the time exponent is the least-squares slope of log(wall seconds) on log(N)
(the fixed start-up, ~30 s, lowers it at small N; the stage-seconds exponent is printed too);
driver bytes/doc the slope of the driver's peak RSS on N. Goals: ours >= 2x datatrove's docs/s
at each compared worker count (largest --datatrove-docs size; every size's ratios are in
`ratio_vs_datatrove_by_docs`); time exponent <= 1.1; driver
growth <= 200 bytes/doc; 1 -> 2 workers >= 1.8x (wall time, largest sweep size); near-dup recall
>= datatrove's with precision >= 0.99; every junk document dropped. The last line is one JSON
object with the headline figures, `goals` saying which pass.

Beside the 1 -> 2 goal, at the largest sweep size: the same work units in bare processes
(`process_unit`, the stage's own, CEILING_UNITS WARC and JSONL units after one to warm up; no Ray,
no services), one alone and then two at once, --ceiling-rounds times: two at once over one alone
is `units_scaling_ceiling_1_to_2`, what 1 -> 2 workers could reach on this machine at that time,
and the CPU seconds of each of the two over those of the one alone is `units_cpu_inflation_1_to_2`.
The pipeline's own figure of that is `worker_cpu_inflation_1_to_2` (the workers' CPU seconds at 2
workers over those at 1, same units); `scaling_1_to_2_by_repeat` has each repeat's 1 -> 2 pair.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import html
import io
import itertools
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from flows.runs import REPO, cli_env, committed_dir

SHARED = REPO.parent / "shared" / "data"
DOCS_PER_FILE = 500
ORIGINAL_FRACTION = 0.08  # documents that are originals of a planted family
JUNK_FRACTION = 0.06
HTML_FRACTION = 0.5
MIN_WORDS, MAX_WORDS = 200, 450
MAX_PARA_SHARE = 0.35  # of a document's words, for any one paragraph
JUNK_KINDS = ("foreign", "short", "spam", "lorem")
LOREM = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
         "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
         "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat.")
REVIEW_ALL = 10**9  # collect.review_samples for the labelled run: every drop with its reason
SAMPLE_S = 0.2
MB = 1024 * 1024


# ---------------------------------------------------------------- the corpus

@dataclass(kw_only=True)
class Corpus:
    root: Path
    urls: list[str]  # document index -> URL (how both systems' outputs map back)
    truth: set[tuple[int, int]]  # planted near-duplicate pairs (i < j)
    junk: dict[int, str]  # document index -> junk kind
    bad_records: int
    nbytes: int  # of the files

    @property
    def sources(self) -> list[str]:
        return [str(self.root / "warc"), str(self.root / "jsonl")]

    def index(self) -> dict[str, int]:
        return {url: i for i, url in enumerate(self.urls)}


def english_paragraphs(shared: Path) -> list[str]:
    """neardup_set's paragraphs that fastText reads as English (p >= 0.8), distinct, in order."""
    from tasks.collect.clean.langid import load_model
    from tasks.collect.dedup.neardup_set import source_paragraphs

    model = load_model()
    out = []
    for para in dict.fromkeys(source_paragraphs(shared)):
        labels, probs = model.predict(" ".join(para.split()), k=1)
        if labels[0] == "__label__en" and probs[0] >= 0.8:
            out.append(para)
    return out


class Composer:
    """Distinct documents of whole paragraphs; no paragraph pair is used twice."""

    def __init__(self, pool: list[str], rng: random.Random):
        self.pool, self.rng = pool, rng
        self.words = [len(p.split()) for p in pool]
        self.used_pairs: set[tuple[int, int]] = set()

    def document(self) -> str:
        while True:
            target, picks, total = self.rng.randint(MIN_WORDS, MAX_WORDS), [], 0
            while total < target:
                i = self.rng.randrange(len(self.pool))
                if i not in picks:
                    picks.append(i)
                    total += self.words[i]
            pairs = {(min(a, b), max(a, b)) for a, b in itertools.combinations(picks, 2)}
            if max(self.words[i] for i in picks) <= MAX_PARA_SHARE * total \
                    and not pairs & self.used_pairs:
                self.used_pairs |= pairs
                return "\n\n".join(self.pool[i] for i in picks)


def junk_document(kind: str, composer: Composer, sentences: dict[str, list[str]],
                  rng: random.Random) -> str:
    if kind == "foreign":
        lines = rng.sample(sentences[rng.choice(sorted(sentences))], rng.randint(10, 16))
        cut = len(lines) // 2
        return " ".join(lines[:cut]) + "\n\n" + " ".join(lines[cut:])
    para = composer.pool[rng.randrange(len(composer.pool))]
    if kind == "short":
        words = para.split()
        start = rng.randrange(max(1, len(words) - 35))
        return " ".join(words[start:start + rng.randint(15, 35)])
    if kind == "spam":
        line = " ".join(para.split()[:rng.randint(6, 12)])
        return "\n".join([line] * rng.randint(12, 25)) + "\n\n" + para
    paras = composer.document().split("\n\n")  # lorem
    paras.insert(rng.randrange(len(paras) + 1), LOREM)
    return "\n\n".join(paras)


def build_texts(n_docs: int, seed: int, shared: Path) -> tuple[list[str], set[tuple[int, int]],
                                                                dict[int, str]]:
    """(texts in corpus order, planted pairs, junk kinds by index)."""
    from tasks.collect.dedup.neardup_set import make_copy
    from tasks.collect.stage import text_hash

    rng = random.Random(seed)
    composer = Composer(english_paragraphs(shared), rng)
    sentences = {p.stem: p.read_text(encoding="utf-8").splitlines()
                 for p in sorted((shared / "multilingual" / "lingua_sentences").glob("*.txt"))
                 if p.stem != "en"}
    seen: set[bytes] = set()

    def distinct(make) -> str:
        """make() until its text is new (exact dedup must remove no unplanted document)."""
        while text_hash(text := make()) in seen:
            pass
        seen.add(text_hash(text))
        return text

    items: list[tuple[str, int | None, str | None]] = []  # (text, family, junk kind)
    n_junk = round(n_docs * JUNK_FRACTION)
    for k in range(n_junk):
        kind = JUNK_KINDS[k % len(JUNK_KINDS)]
        items.append((distinct(lambda kind=kind: junk_document(kind, composer, sentences, rng)),
                      None, kind))
    family = 0
    while len(items) < n_docs:
        if family < round(n_docs * ORIGINAL_FRACTION):
            original = distinct(composer.document)
            copies = rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
            members = [original] + [distinct(lambda original=original: make_copy(original, rng))
                                    for _ in range(copies)]
            items += [(text, family, None) for text in members[:n_docs - len(items)]]
            family += 1
        else:
            items.append((distinct(composer.document), None, None))
    rng.shuffle(items)
    families: dict[int, list[int]] = {}
    for i, (_, fam, _) in enumerate(items):
        if fam is not None:
            families.setdefault(fam, []).append(i)
    truth = {pair for members in families.values() for pair in itertools.combinations(members, 2)}
    return [t for t, _, _ in items], truth, {i: k for i, (_, _, k) in enumerate(items) if k}


def html_page(text: str, url: str) -> bytes:
    paras = text.split("\n\n")
    title = html.escape(" ".join(paras[0].split()[:8]))
    body = "\n".join("<p>" + "<br>\n".join(html.escape(line) for line in p.split("\n")) + "</p>"
                     for p in paras)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f'</head>\n<body><header><nav><a href="/">Home</a> | <a href="/about">About</a> | '
            f'<a href="/contact">Contact</a></nav></header>\n<main><article><h1>{title}</h1>\n'
            f'{body}\n</article></main>\n<footer><p>{html.escape(url.split("/")[2])}</p></footer>'
            f"</body></html>\n").encode()


def _warc_record(writer, url: str, payload: bytes, content_type: str, n: int):
    from warcio.statusandheaders import StatusAndHeaders

    http = StatusAndHeaders("200 OK", [("Content-Type", content_type),
                                       ("Content-Length", str(len(payload)))], protocol="HTTP/1.1")
    headers = {"WARC-Date": "2024-05-18T00:00:00Z",  # fixed: the same corpus for every run
               "WARC-Record-ID": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, f'{url}#{n}')}>",
               "WARC-Identified-Payload-Type": content_type.split(";")[0]}
    return writer.create_warc_record(url, "response", payload=io.BytesIO(payload),
                                     http_headers=http, warc_headers_dict=headers)


def write_corpus(n_docs: int, seed: int, root: Path, shared: Path = SHARED) -> Corpus:
    from warcio.warcwriter import WARCWriter

    texts, truth, junk = build_texts(n_docs, seed, shared)
    rng = random.Random(seed + 1)
    urls = [f"https://site{rng.randrange(1000):03d}.example.com/page/{i:07d}.html"
            for i in range(n_docs)]
    is_html = [rng.random() < HTML_FRACTION for _ in range(n_docs)]
    bad = 0
    for kind in ("warc", "jsonl"):
        (root / kind).mkdir(parents=True)
        chosen = [i for i in range(n_docs) if is_html[i] == (kind == "warc")]
        for f, start in enumerate(range(0, len(chosen), DOCS_PER_FILE)):
            part = chosen[start:start + DOCS_PER_FILE]
            bad_at = rng.randrange(len(part))
            if kind == "warc":
                with open(root / kind / f"part-{f:05d}.warc.gz", "wb") as out:
                    writer = WARCWriter(out, gzip=True)
                    for j, i in enumerate(part):
                        if j == bad_at:  # an image: not a document
                            png = b"\x89PNG\r\n\x1a\n" + rng.randbytes(2000)
                            writer.write_record(_warc_record(writer, f"{urls[i]}.png", png,
                                                             "image/png", 0))
                        writer.write_record(_warc_record(writer, urls[i], html_page(texts[i], urls[i]),
                                                         "text/html; charset=utf-8", 1))
                bad += 1
            else:
                with gzip.open(root / kind / f"part-{f:05d}.jsonl.gz", "wt", encoding="utf-8") as out:
                    for j, i in enumerate(part):
                        if j == bad_at:  # a line that is not JSON, a record without text
                            out.write('{"id": "broken", "text": "cut off\n')
                            out.write(json.dumps({"id": f"empty-{i}", "url": f"{urls[i]}?empty"}) + "\n")
                        out.write(json.dumps({"id": f"doc-{i:07d}", "text": texts[i], "url": urls[i]}) + "\n")
                bad += 2
    nbytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return Corpus(root=root, urls=urls, truth=truth, junk=junk, bad_records=bad, nbytes=nbytes)


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
                    elif "flows.supervised" in cmdline:
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
    from tasks.collect.dedup.neardup_set import precision_recall

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
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", *overrides,
           "--until", "collect"]
    home.mkdir(parents=True)
    seconds, peaks = run_tree(cmd, home.parent / f"{home.name}.log", cli_env(home))
    out = committed_dir(home, "collect")
    funnel = json.loads((out / "funnel.json").read_text())
    stage_s = json.loads((out / "manifest.json").read_text())["meta"]["seconds"]
    kept = _read_jsonl_gz(out.glob("docs/part-*.jsonl.gz"))
    kept_urls = {d["url"] for d in kept}
    run = {"system": "ours", "docs": len(corpus.urls), "workers": workers, "seconds": seconds,
           "stage_s": stage_s,
           **peaks.figures(), "kept": len(kept_urls),
           "junk_kept": sum(corpus.urls[i] in kept_urls for i in corpus.junk),
           "disk_mb": round(sum(p.stat().st_size for p in (home / "artifacts").rglob("*")
                                if p.is_file()) / MB, 1),
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

def datatrove_child(spec: dict[str, Any]) -> dict[str, float]:
    """Run datatrove's pipeline (module docstring); seconds per executor run."""
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
    seconds = {}
    for name, (pipeline, tasks) in steps.items():
        start = time.perf_counter()
        run_datatrove(pipeline, work / f"logs-{name}", tasks=tasks, workers=min(tasks, workers))
        seconds[name] = round(time.perf_counter() - start, 2)
    return seconds


def run_peer(corpus: Corpus, workers: int, work: Path) -> dict[str, Any]:
    spec = {"warc": corpus.sources[0], "jsonl": corpus.sources[1], "work": str(work),
            "workers": workers}
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "bench.scale", "--datatrove-child", json.dumps(spec)]
    seconds, peaks = run_tree(cmd, work.parent / f"{work.name}.log")
    steps = json.loads((work.parent / f"{work.name}.log").read_text().strip().splitlines()[-1])
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
            "near_duplicates": len(removed), "steps_s": steps,
            "quality": near_dup_quality(corpus, _labels(corpus, clusters), cleaned)}


# ---------------------------------------------------------------- the machine's own 1 -> 2

CEILING_UNITS = 6  # of each kind (WARC, JSONL) a ceiling child times, after one to warm up


def units_child(spec: dict[str, Any]) -> dict[str, float]:
    """Wall and CPU seconds for one bare process (no Ray, no services) to run the collect stage's
    own `process_unit` over CEILING_UNITS WARC and JSONL units of the corpus each, after a first
    unit that loads the models."""
    from bench.memory import _tiny_collect
    from tasks.collect.stage import plan_units, process_unit, unit_result_path

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


# ---------------------------------------------------------------- the benchmark

@dataclass(kw_only=True)
class Results:
    runs: list[dict[str, Any]] = field(default_factory=list)  # every timed run
    quality: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # (system, N)
    corpus: dict[int, dict[str, Any]] = field(default_factory=dict)
    units_ceiling: tuple[float, float] | None = None  # units_ceiling() at the largest sweep size

    def median(self, system: str, n: int, workers: int, key: str) -> float | None:
        values = [r[key] for r in self.runs
                  if (r["system"], r["docs"], r["workers"]) == (system, n, workers)]
        return statistics.median(values) if values else None


def measure(args: argparse.Namespace, work: Path) -> Results:
    res = Results()
    top = max(args.workers)
    for n in args.docs:
        started = time.perf_counter()
        corpus = write_corpus(n, args.seed, work / f"corpus-{n}-{args.seed}")
        res.corpus[n] = {"mb": round(corpus.nbytes / MB, 1), "planted_pairs": len(corpus.truth),
                         "junk": len(corpus.junk), "bad_records": corpus.bad_records,
                         "build_s": round(time.perf_counter() - started, 1)}
        _log(f"corpus {n}: {res.corpus[n]}")
        for r in range(args.repeats):
            for w in args.workers if n in args.sweep_docs else [top]:
                run = run_ours(corpus, w, work / f"home-{n}-w{w}-r{r}")
                assert run["accounting_balanced"], f"accounting does not balance: {run['accounting']}"
                res.runs.append(run)
                _log(run)
                if n in args.datatrove_docs:
                    res.runs.append(run_peer(corpus, w, work / f"datatrove-{n}-w{w}-r{r}"))
                    _log(res.runs[-1])
                if not args.keep:
                    for path in work.glob(f"*-{n}-w{w}-r{r}"):
                        shutil.rmtree(path)
        if n == max(args.sweep_docs) and {1, 2} <= set(args.workers) and args.ceiling_rounds:
            res.units_ceiling = units_ceiling(corpus, args.ceiling_rounds, work / f"ceiling-{n}")
        if n in args.datatrove_docs:
            labelled = run_ours(corpus, top, work / f"home-{n}-labelled", labelled=True)
            res.quality[("ours", n)] = labelled["quality"]
            res.quality[("datatrove", n)] = next(r["quality"] for r in reversed(res.runs)
                                                 if r["system"] == "datatrove" and r["docs"] == n)
            _log(labelled)
        if not args.keep:
            shutil.rmtree(corpus.root)
            shutil.rmtree(work / f"home-{n}-labelled", ignore_errors=True)
    return res


def _log(item: Any) -> None:
    print(f"  {item}", file=sys.stderr, flush=True)


def fit(xs: list[float], ys: list[float], log: bool) -> float | None:
    """Least-squares slope of y on x (of log y on log x when `log`); None under 2 sizes."""
    if len(set(xs)) < 2:
        return None
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    return float(np.polyfit(np.log(x), np.log(y), 1)[0] if log else np.polyfit(x, y, 1)[0])


def report(args: argparse.Namespace, res: Results) -> int:
    print(f"collect at scale: seed {args.seed}, median of {args.repeats}; corpus "
          + "; ".join(f"{n:,} docs {c['mb']} MB, {c['planted_pairs']} planted pairs, {c['junk']} "
                      f"junk, {c['bad_records']} bad records" for n, c in res.corpus.items()))
    print(f"{'system':<10}{'docs':>8}{'W':>3}{'seconds':>9}{'stage s':>8}{'docs/s':>8}{'MB/s':>7}"
          f"{'driver MB':>10}{'workers MB':>16}{'tree MB':>9}{'disk MB':>8}{'kept':>7}"
          f"{'junk kept':>10}  accounting")
    for system, n, w in sorted({(r["system"], r["docs"], r["workers"]) for r in res.runs},
                               key=lambda k: (k[1], k[2], k[0] != "ours")):
        def med(key: str, system=system, n=n, w=w) -> Any:
            return res.median(system, n, w, key)

        last = next(r for r in reversed(res.runs) if (r["system"], r["docs"], r["workers"]) == (system, n, w))
        workers_mb = "/".join(f"{m:.0f}" for m in last.get("worker_peak_mb", [])) or "-"
        driver, stage = (f"{med('driver_peak_mb'):.0f}", f"{med('stage_s'):.1f}") \
            if system == "ours" else ("-", "-")
        print(f"{system:<10}{n:>8}{w:>3}{med('seconds'):>9.1f}{stage:>8}{n / med('seconds'):>8.1f}"
              f"{res.corpus[n]['mb'] / med('seconds'):>7.2f}{driver:>10}{workers_mb:>16}"
              f"{med('tree_peak_mb'):>9.0f}{med('disk_mb'):>8.1f}{last['kept']:>7}"
              f"{last['junk_kept']:>5}/{res.corpus[n]['junk']:<4}  {last.get('accounting', '-')}")
    for (system, n), q in res.quality.items():
        print(f"near dup {system:<10}{n:>8}: precision {q['precision']:.4f}, recall {q['recall']:.4f} "
              f"over {q['pairs']} of {q['planted_pairs']} planted pairs that reached near dedup")
    ours = [r for r in res.runs if r["system"] == "ours"]
    top, largest = max(args.workers), max(args.docs)
    sizes = sorted(args.docs)
    time_exp, stage_exp, driver_slope, fitted = {}, {}, {}, {}
    for w in args.workers:  # over the sizes it ran at
        at = fitted[w] = [n for n in sizes if res.median("ours", n, w, "seconds") is not None]
        time_exp[w] = fit(at, [res.median("ours", n, w, "seconds") for n in at], log=True)
        stage_exp[w] = fit(at, [res.median("ours", n, w, "stage_s") for n in at], log=True)
        driver_slope[w] = fit(at, [res.median("ours", n, w, "driver_peak_mb") * MB for n in at],
                              log=False)
    ratios_by_docs = {n: {w: res.median("datatrove", n, w, "seconds") / res.median("ours", n, w, "seconds")
                          for w in args.workers if res.median("datatrove", n, w, "seconds")}
                      for n in sorted(args.datatrove_docs)}
    n_dt = max(args.datatrove_docs)  # the goal is judged at the largest size compared
    ratios = ratios_by_docs[n_dt]
    n_sweep = max(args.sweep_docs)
    swept = {1, 2} <= set(args.workers)
    scaling = (res.median("ours", n_sweep, 1, "seconds") / res.median("ours", n_sweep, 2, "seconds")
               if swept else None)
    # The same units at either count: CPU time more at 2 workers is the second worker's own start
    # (imports, models) plus what two busy vCPUs cost each other (shared caches, memory, the host).
    worker_cpu = {w: res.median("ours", n_sweep, w, "worker_cpu_s") for w in (1, 2)} if swept else {}
    by_repeat = [one["seconds"] / two["seconds"] for one, two in zip(
        *([r for r in res.runs if (r["system"], r["docs"], r["workers"]) == ("ours", n_sweep, w)]
          for w in (1, 2)))] if swept else []
    q_ours, q_peer = res.quality[("ours", n_dt)], res.quality[("datatrove", n_dt)]
    time_exponent, bytes_per_doc = time_exp[top], driver_slope[top]  # the count run at every N
    goals = {
        "docs_s_ge_2x_datatrove": all(r >= 2 for r in ratios.values()),
        "time_exponent_le_1.1": time_exponent is not None and time_exponent <= 1.1,
        "driver_le_200_bytes_per_doc": bytes_per_doc is not None and bytes_per_doc <= 200,
        "scaling_1_to_2_ge_1.8": scaling is not None and scaling >= 1.8,
        "recall_ge_datatrove_precision_ge_0.99": q_ours["recall"] >= q_peer["recall"]
                                                  and q_ours["precision"] >= 0.99,
        "junk_dropped": all(r["junk_kept"] == 0 for r in res.runs),
        "accounting_balanced": all(r["accounting_balanced"] for r in ours),
    }
    for w in args.workers:
        if time_exp[w] is not None:
            print(f"fit over {', '.join(f'{n:,}' for n in fitted[w])} docs, {w} worker(s): time "
                  f"exponent {time_exp[w]:.3f} (the stage alone {stage_exp[w]:.3f}), driver peak "
                  f"RSS {driver_slope[w]:+.0f} bytes/doc")
    if swept:
        print(f"1 -> 2 workers at {n_sweep:,} docs: {scaling:.3f}x (each repeat: "
              f"{', '.join(f'{x:.3f}' for x in by_repeat)}); the workers' CPU for the same work "
              f"{worker_cpu[1]:.1f} s at 1 worker, {worker_cpu[2]:.1f} s at 2 "
              f"(x{worker_cpu[2] / worker_cpu[1]:.3f})")
    if res.units_ceiling is not None:
        ceiling, inflation = res.units_ceiling
        print(f"the same units in bare processes, two at once against one alone: {ceiling:.3f}x, "
              f"CPU time per unit x{inflation:.3f} (medians of {args.ceiling_rounds} rounds; the "
              f"ceiling of 1 -> 2 workers on this machine now)")
    print("goals: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in goals.items()))
    print(json.dumps({
        "bench": "scale", "docs": largest, "sizes": sizes, "workers": args.workers,
        "datatrove_docs": args.datatrove_docs, "sweep_docs": args.sweep_docs, "repeats": args.repeats,
        "seed": args.seed,
        "docs_s": round(largest / res.median("ours", largest, top, "seconds"), 1),
        "mb_s": round(res.corpus[largest]["mb"] / res.median("ours", largest, top, "seconds"), 2),
        "ratio_vs_datatrove": round(ratios[top], 3), "ratio_at_docs": n_dt, "scaling_at_docs": n_sweep,
        "ratio_vs_datatrove_by_workers": {str(w): round(r, 3) for w, r in ratios.items()},
        "ratio_vs_datatrove_by_docs": {str(n): {str(w): round(r, 3) for w, r in by_w.items()}
                                       for n, by_w in ratios_by_docs.items()},
        "time_exponent": None if time_exponent is None else round(time_exponent, 3),
        "time_exponent_by_workers": {str(w): round(v, 3) for w, v in time_exp.items() if v is not None},
        "stage_time_exponent_by_workers": {str(w): round(v, 3) for w, v in stage_exp.items()
                                           if v is not None},
        "driver_bytes_per_doc": None if bytes_per_doc is None else round(bytes_per_doc, 1),
        "driver_bytes_per_doc_by_workers": {str(w): round(v, 1) for w, v in driver_slope.items()
                                            if v is not None},
        "scaling_1_to_2_workers": None if scaling is None else round(scaling, 3),
        "scaling_1_to_2_by_repeat": [round(x, 3) for x in by_repeat],
        "worker_cpu_s_by_workers": {str(w): v for w, v in worker_cpu.items()},
        "worker_cpu_inflation_1_to_2": round(worker_cpu[2] / worker_cpu[1], 3) if swept else None,
        "units_scaling_ceiling_1_to_2": None if res.units_ceiling is None else round(res.units_ceiling[0], 3),
        "units_cpu_inflation_1_to_2": None if res.units_ceiling is None else round(res.units_ceiling[1], 3),
        "precision": q_ours["precision"], "recall": q_ours["recall"],
        "datatrove_precision": q_peer["precision"], "datatrove_recall": q_peer["recall"],
        "accounting_balanced": goals["accounting_balanced"], "goals": goals,
        "runs": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                  if k not in ("quality", "accounting")} for r in res.runs]}))
    return 0


def _sizes(value: str) -> list[int]:
    return sorted({int(float(x)) for x in value.split(",")})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=_sizes, default=[10_000, 30_000, 100_000],
                        help="corpus sizes N, comma-separated (exponents need 2 or more)")
    parser.add_argument("--workers", type=_sizes, default=[1, 2], help="collect.num_workers values")
    parser.add_argument("--sweep-docs", type=_sizes,
                        help="sizes run at every worker count (default: all; the others run at the "
                             "largest only)")
    parser.add_argument("--datatrove-docs", type=_sizes,
                        help="sizes where datatrove runs too, at each worker count of the sweep "
                             "(default: the smallest N)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="write corpora, homes and logs here and keep them")
    parser.add_argument("--ceiling-rounds", type=int, default=3,
                        help="rounds of the units' own 1 -> 2 ceiling at the largest sweep size (0: skip)")
    parser.add_argument("--datatrove-child", help=argparse.SUPPRESS)
    parser.add_argument("--units-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.datatrove_child:
        print(json.dumps(datatrove_child(json.loads(args.datatrove_child))))
        return 0
    if args.units_child:
        print(json.dumps(units_child(json.loads(args.units_child))))
        return 0
    args.sweep_docs = args.sweep_docs or args.docs
    args.datatrove_docs = args.datatrove_docs or args.docs[:1]
    if not set(args.datatrove_docs) <= set(args.sweep_docs) <= set(args.docs):
        parser.error("--datatrove-docs must be among --sweep-docs, and those among --docs")
    with contextlib.ExitStack() as stack:
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-scale-")))
        work.mkdir(parents=True, exist_ok=True)
        return report(args, measure(args, work))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
