"""The collect stage at scale: the real CLI over a web-like corpus of N documents, against
datatrove's equivalent pipeline on the same files, and from 1 to 2 workers.

    python -m bench scale --docs 10000,30000,100000 [--workers 1,2] [--sweep-docs 10000,30000]
                          [--datatrove-docs 10000] [--repeats 1] [--seed 0] [--keep DIR]
                          [--docs-per-file 500] [--smoke]

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
dolma-style JSON lines (jsonl/part-*.jsonl.gz), 500 documents a file (`--docs-per-file`), so both
systems get many files to share out. Bad input beside the N documents: each JSONL file has a line
that is not JSON and a record without text, each WARC file an image response.

  ours       `gristmill run configs/tiny.yaml collect.sources=[warc dir, jsonl dir]
             collect.num_workers=W --until collect` in a fresh GRISTMILL_HOME (a new process:
             Ray, spaCy and fastText start cold); wall seconds of the whole command, and the
             stage's own seconds from its manifest (from planning the units to the committed
             output: Ray's start-up is in it, the CLI's imports and the embedded Prefect server
             are not). The stage records sampled RSS peaks (`peak_rss_mb`, `driver_peak_rss_mb`,
             `worker_peak_rss_mb`), which miss a spike between samples, so this benchmark samples
             the process tree every 0.2 s too: each process's VmHWM (the kernel's
             RSS high-water mark, so a peak between samples is not missed, only growth in a
             process's last 0.2 s) for the driver (`python -m gristmill.flows.supervised`, the child of
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
driver bytes/doc the slope of the driver's peak RSS on N. Goals: ours >= 3x datatrove's docs/s
at each compared worker count (largest --datatrove-docs size; every size's ratios are in
`ratio_vs_datatrove_by_docs`); time exponent <= 1.1; driver
growth <= 200 bytes/doc; 1 -> 2 workers >= 1.9x (wall time, largest sweep size); near-dup recall
>= datatrove's with precision >= 0.99; every junk document dropped. The last line is one JSON
object with the headline figures, `goals` saying which pass, and the CPU (`cpu`: model, the
vector instructions torch's kernels use, cores).

Where the time goes, at each (N, W) both systems ran (`steps_s`): each system's seconds per step
from its own counters, medians. The record's steps (read and extract, URL filter, language ID,
quality filters, PII, write; ours also decontamination) are summed over the workers: ours from each
work unit's clock (tasks/collect/timing.py), datatrove's from its blocks' time_stats in the
cleaning executor's stats.json, its MinHash signature block included. The corpus steps are wall
seconds: ours as the stage's driver laps them (merge, exact dedup, the signatures' map, the rest
of near dedup, mix, writing the shards), datatrove's near dedup as its buckets, cluster and filter
executors took. `cold_start_s_by_workers`: a worker's seconds before its first record (spaCy,
fastText, trafilatura; the mean over the workers, from the stage's counters), the parts in
`python -m bench worker-start`.

Beside the 1 -> 2 goal, at the largest sweep size: the same work units in bare processes
(`process_unit`, the stage's own, CEILING_UNITS WARC and JSONL units after one to warm up; no Ray,
no services), one alone and then two at once, --ceiling-rounds times: two at once over one alone
is `units_scaling_ceiling_1_to_2`, what 1 -> 2 workers could reach on this machine at that time,
and the CPU seconds of each of the two over those of the one alone is `units_cpu_inflation_1_to_2`.
The pipeline's own figure of that is `worker_cpu_inflation_1_to_2` (the workers' CPU seconds at 2
workers over those at 1, same units); `scaling_1_to_2_by_repeat` has each repeat's 1 -> 2 pair.

The corpus is built in bench/scale_corpus.py and each system's runs are made and measured in
bench/scale_runs.py; this module chooses the runs, fits and judges the figures, and reports them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import smoke
from bench.harness.runs import cpu_description
from bench.scale_corpus import DOCS_PER_FILE, write_corpus
from bench.scale_runs import (
    MB,
    _log,
    datatrove_child,
    run_ours,
    run_peer,
    units_ceiling,
    units_child,
)

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
        corpus = write_corpus(n, args.seed, work / f"corpus-{n}-{args.seed}", docs_per_file=args.docs_per_file)
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



def fit(xs: list[float], ys: list[float], log: bool) -> float | None:
    """Least-squares slope of y on x (of log y on log x when `log`); None under 2 sizes."""
    if len(set(xs)) < 2:
        return None
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    return float(np.polyfit(np.log(x), np.log(y), 1)[0] if log else np.polyfit(x, y, 1)[0])


# A worker's loading, the stage's steps in a record's order, then the corpus-level ones
# (tasks/collect/timing.py; datatrove loads inside its blocks, has no decontamination, exact dedup
# or mixing, and its near dedup is three executors).
STEP_ORDER = ("cold_start", "read_extract", "url_filter", "language_id", "quality_filters", "pii", "decontamination",
              "write", "merge", "exact_dedup", "minhash_signatures", "near_dedup", "mix", "write_shards")
PER_RECORD = STEP_ORDER[:8]


def step_table(res: Results) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Each step's median seconds, ours beside datatrove's, at every (N, W) both ran, printed;
    returned as {N: {W: {system: {step: s}}}}."""
    table: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for n, w in sorted({(r["docs"], r["workers"]) for r in res.runs if r["system"] == "datatrove"}):
        both = {system: [r["steps_s"] for r in res.runs if (r["system"], r["docs"], r["workers"]) == (system, n, w)]
                for system in ("ours", "datatrove")}
        medians = {system: {step: statistics.median(run.get(step, 0.0) for run in runs)
                            for step in STEP_ORDER if any(step in run for run in runs)}
                   for system, runs in both.items()}
        table.setdefault(str(n), {})[str(w)] = {system: {k: round(v, 3) for k, v in m.items()}
                                                for system, m in medians.items()}
        print(f"seconds per step at {n:,} docs, {w} worker(s), median of {len(both['ours'])} (the record's "
              f"steps: summed over the workers, from each system's counters; the corpus steps: wall)")
        print(f"  {'step':<20}{'ours':>9}{'datatrove':>11}{'ratio':>8}")
        for step in STEP_ORDER:
            ours, peer = medians["ours"].get(step), medians["datatrove"].get(step)
            if ours is None and peer is None:
                continue
            ratio = f"{peer / ours:>8.2f}" if ours and peer else f"{'-':>8}"
            print(f"  {step:<20}{'-' if ours is None else f'{ours:.2f}':>9}"
                  f"{'-' if peer is None else f'{peer:.2f}':>11}{ratio}")
        for system in ("ours", "datatrove"):
            print(f"  {system}: the record's steps {sum(medians[system].get(s, 0.0) for s in PER_RECORD):.2f} s "
                  f"summed over workers")
    return table


def report(args: argparse.Namespace, res: Results) -> int:
    cpu = cpu_description()
    print(f"on {cpu['model']} ({cpu['capability']}, {cpu['cores']} cores)")
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
    steps = step_table(res)
    goals = {
        "docs_s_ge_3x_datatrove": all(r >= 3 for r in ratios.values()),
        "time_exponent_le_1.1": time_exponent is not None and time_exponent <= 1.1,
        "driver_le_200_bytes_per_doc": bytes_per_doc is not None and bytes_per_doc <= 200,
        "scaling_1_to_2_ge_1.9": scaling is not None and scaling >= 1.9,
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
        "seed": args.seed, "cpu": cpu_description(),
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
        "accounting_balanced": goals["accounting_balanced"], "goals": goals, "steps_s": steps,
        "cold_start_s_by_workers": {str(w): res.median("ours", largest, w, "cold_start_s") for w in args.workers
                                    if res.median("ours", largest, w, "cold_start_s") is not None},
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
    parser.add_argument("--docs-per-file", type=int, default=DOCS_PER_FILE,
                        help="documents a corpus file holds, of each kind (WARC, JSONL)")
    parser.add_argument("--datatrove-child", help=argparse.SUPPRESS)
    parser.add_argument("--units-child", help=argparse.SUPPRESS)
    # Smoke: two sizes (the fits), both worker counts and datatrove at the smaller (the ratios, the
    # 1 -> 2 pair, the ceiling, whose units need two files of each kind), the larger at 2 workers.
    args = smoke.parse(parser, argv, docs=[100, 200], workers=[1, 2], sweep_docs=[100], datatrove_docs=[100],
                       ceiling_rounds=1, docs_per_file=25)
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
