"""Cleaning throughput: our chain against datatrove's executor, and from 1 to 2 Ray workers.

    python -m bench clean [--docs 2000] [--repeats 3] [--chunks 8] [--smoke]

Documents: the text of every page in the shared WARC files and JSONL documents
(../shared/data/{warc,jsonl}), extracted once with the collect stage's readers before any timing,
repeated in order up to `--docs`. One config for every method (the collect defaults plus a small
block list), and the same chain:

  ours        `clean_documents` over `--chunks` chunks on SerialEngine (one process), warm:
              the word splitter has seen these documents (rules.py caches each distinct
              whitespace-free chunk's spaCy tokens, as a worker does over a crawl)
  ours-cold   `clean_documents` over the distinct documents once, after rules.clear_caches():
              every word is new to the splitter, as in a fresh worker (its seconds are
              scaled to `--docs` documents)
  datatrove   LocalPipelineExecutor(tasks=1, workers=1): the documents, LambdaFilter (the same
              URL rule: datatrove's URLFilter needs tldextract, whose first use fetches the public
              suffix list), LanguageFilter with the bundled lid.176.ftz, GopherQuality,
              GopherRepetition, FineWebQuality, C4Quality (the same constructor arguments as ours,
              the same order), PIIFormatter
  ray-N       `clean_documents` over the same chunks on RayEngine(num_workers=N), N = 1, 2;
              only the map is timed, after a warm-up map of the same chunks that starts the
              engine's actors, loads spaCy and fastText in them and warms their word splitters
              as `ours` is warmed (actors live until shutdown, as in the stage);
              map_overhead_s is what a map costs beyond the work, a map of one document per
              worker

Each repeat runs every method once, interleaved; figures are medians. docs/s counts input
documents. The run fails unless both chains keep the same documents, every one of them (the
quality rules decide as datatrove's blocks; a language score between the two readings of it
could still differ: ours reads a 4000-character prefix and keeps score >= threshold, datatrove
reads the whole text and keeps score > threshold; each distinct document judged differently is
printed with both scores first). PII scrubbing never changes a verdict (ours replaces more
kinds). The last line is one JSON object with `ratio_vs_datatrove` (ours ÷ datatrove, one
worker each), `ratio_cold_vs_datatrove` (ours-cold ÷ datatrove) and `scaling_1_to_2_workers`
(ray-2 ÷ ray-1 docs/s).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import gristmill.tasks.collect.stage as collect
from bench import smoke
from bench.harness.pages import Page, shared_pages
from bench.harness.runs import SHARED_DATA
from gristmill.tasks.collect.clean.cleaning import CleanOutcome, clean_documents
from gristmill.tasks.collect.clean.langid import bundled_ft176

BLOCKED_DOMAINS = ("archive.org",)  # a few shared pages, so the URL rule has work to do
BLOCKED_SUBSTRINGS = ("/robots.txt",)


def load_docs(n_docs: int) -> tuple[list[Page], int]:
    """The shared pages repeated in order to n_docs; also how many are distinct."""
    unique = shared_pages(SHARED_DATA)
    return [unique[i % len(unique)] for i in range(n_docs)], len(unique)


def chunked(docs: list[Page], n_chunks: int) -> list[list[Page]]:
    bounds = [len(docs) * i // n_chunks for i in range(n_chunks + 1)]
    return [docs[a:b] for a, b in itertools.pairwise(bounds)]


def run_ours(chunks: list[list[Page]], cfg: collect.Config) -> list[CleanOutcome]:
    from gristmill.core.stage import SerialEngine

    return [o for part in SerialEngine().map(partial(clean_documents, cfg=cfg), chunks)
            for o in part]


def datatrove_filters(cfg: collect.Config) -> list[Any]:
    """datatrove's blocks for our cleaning chain, in its order, built fresh (LanguageFilter
    loads its model lazily): the URL rule, language, Gopher quality and repetition, FineWeb, C4
    (our constructor arguments), PII."""
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
        LambdaFilter,
        LanguageFilter,
    )
    from datatrove.pipeline.formatters import PIIFormatter

    import gristmill.tasks.collect.clean.filters as text_filters

    def kwargs(kind: str) -> dict[str, Any]:
        return text_filters.block_kwargs(kind, cfg)

    language_filter = LanguageFilter(languages=list(cfg.allowed_languages),
                                     language_threshold=cfg.min_language_score)
    language_filter.model = bundled_ft176(list(cfg.allowed_languages))
    return [
        LambdaFilter(lambda doc: text_filters.url_blocked(doc.metadata["url"], cfg) is None),
        language_filter,
        GopherQualityFilter(**kwargs("gopher_quality")),
        GopherRepetitionFilter(**kwargs("gopher_repetition")),
        FineWebQualityFilter(**kwargs("fineweb_quality")),
        C4QualityFilter(**kwargs("c4_quality")),
        PIIFormatter(),
    ]


def datatrove_pipeline(docs: list[Page], cfg: collect.Config, kept_ids: list[str]) -> list[Any]:
    """The equivalent datatrove chain over `docs`, appending the ids it keeps to kept_ids."""
    from datatrove.data import Document

    def sink(data, rank: int = 0, world_size: int = 1):
        for doc in data:
            kept_ids.append(doc.id)
            yield doc

    return [
        [Document(text=text, id=str(i), metadata={"url": url}) for i, (text, url) in enumerate(docs)],
        *datatrove_filters(cfg),
        sink,
    ]


def run_datatrove(pipeline: list[Any], logging_dir: Path, tasks: int = 1, workers: int = 1) -> None:
    """LocalPipelineExecutor over `pipeline`, its per-task logging kept off stderr (shown when
    it fails)."""
    from datatrove.executor import LocalPipelineExecutor

    log = io.StringIO()
    try:
        with contextlib.redirect_stderr(log):  # datatrove logs every task to stderr
            LocalPipelineExecutor(pipeline, tasks=tasks, workers=workers,
                                  logging_dir=str(logging_dir), skip_completed=False).run()
    except Exception:
        print(log.getvalue()[-4000:], file=sys.stderr)
        raise


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def compare_verdicts(docs: list[Page], ours: list[CleanOutcome], datatrove_kept: set[str],
                     n_unique: int) -> dict[str, int]:
    """Print and count the distinct documents the two chains judge differently."""
    from gristmill.tasks.collect.clean.langid import load_model

    n_unique = min(n_unique, len(ours))
    differ = [i for i in range(n_unique) if ours[i].kept != (str(i) in datatrove_kept)]
    for i in differ:
        text, url = docs[i]
        labels, probs = load_model().predict(" ".join(text.split()), k=-1)
        en = dict(zip(labels, probs)).get("__label__en", 0.0)
        print(f"  differ: {url[:60]:<60} ours={ours[i].reason or 'kept'} "
              f"(score {ours[i].language_score or 0:.3f} on the prefix), datatrove "
              f"{'kept' if str(i) in datatrove_kept else 'dropped'} (en {en:.3f} on the full text)")
    return {"distinct_docs": n_unique, "distinct_differ": len(differ)}


@dataclass(kw_only=True)
class Measurements:
    seconds: dict[str, list[float]] = field(
        default_factory=lambda: {m: [] for m in ("ours", "ours-cold", "datatrove", "ray-1",
                                                 "ray-2")})
    map_overhead_s: dict[int, float] = field(default_factory=dict)
    ours: list[CleanOutcome] = field(default_factory=list)  # the last repeat's outcomes
    datatrove_kept: list[str] = field(default_factory=list)  # ids of the last repeat


def measure(docs: list[Page], n_unique: int, cfg: collect.Config, n_chunks: int, repeats: int,
            scratch: Path) -> Measurements:
    """Warm every method up, then time each once per repeat, interleaved."""
    from gristmill.infra.ray_engine import RayEngine
    from gristmill.tasks.collect.clean.rules import clear_caches

    m = Measurements()
    chunks, warm = chunked(docs, n_chunks), chunked(docs[:n_unique], 2)
    fn = partial(clean_documents, cfg=cfg)
    warm_outcomes = run_ours(warm, cfg)  # loads spaCy and fastText, as a busy worker has
    # The fixed cost of a map: one document per worker that goes through every filter.
    probe = [docs[[o.kept for o in warm_outcomes].index(True)]]
    run_datatrove(datatrove_pipeline(docs[:n_unique], cfg, []), scratch / "warm")
    engines = {n: RayEngine(num_workers=n) for n in (1, 2)}
    try:
        for n, engine in engines.items():
            engine.map(fn, chunks)
            m.map_overhead_s[n] = timed(engine.map, fn, [probe] * n)[0]
        for r in range(repeats):
            seconds, m.ours = timed(run_ours, chunks, cfg)
            m.seconds["ours"].append(seconds)
            clear_caches()
            seconds, cold = timed(clean_documents, docs[:n_unique], cfg)
            m.seconds["ours-cold"].append(seconds * len(docs) / n_unique)  # per len(docs)
            assert [o.reason for o in cold] == [o.reason for o in m.ours[:n_unique]]
            m.datatrove_kept = []
            pipeline = datatrove_pipeline(docs, cfg, m.datatrove_kept)
            m.seconds["datatrove"].append(timed(run_datatrove, pipeline, scratch / f"r{r}")[0])
            for n, engine in engines.items():
                seconds, parts = timed(engine.map, fn, chunks)
                m.seconds[f"ray-{n}"].append(seconds)
                assert [o.reason for p in parts for o in p] == [o.reason for o in m.ours]
    finally:
        for engine in engines.values():
            engine.shutdown()
    return m


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench clean", description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=2000, help="documents per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=8, help="work units per map (all methods)")
    args = smoke.parse(parser, argv, docs=40, repeats=1, chunks=2)
    from gristmill.infra.env import OFFLINE_AND_QUIET

    for name, value in OFFLINE_AND_QUIET.items():  # read by ray at import
        os.environ.setdefault(name, value)
    docs, n_unique = load_docs(args.docs)
    cfg = collect.Config(blocked_domains=BLOCKED_DOMAINS, blocked_url_substrings=BLOCKED_SUBSTRINGS)
    with tempfile.TemporaryDirectory(prefix="bench-clean-") as tmp:
        m = measure(docs, n_unique, cfg, args.chunks, args.repeats, Path(tmp))
    docs_s = {name: args.docs / statistics.median(ts) for name, ts in m.seconds.items()}
    kept_ours = sum(o.kept for o in m.ours)
    print(f"{args.docs} docs ({n_unique} distinct, repeated), {args.chunks} chunks, "
          f"median of {args.repeats}; kept: ours {kept_ours}, datatrove {len(m.datatrove_kept)}")
    verdicts = compare_verdicts(docs, m.ours, set(m.datatrove_kept), n_unique)
    kept_datatrove = set(m.datatrove_kept)
    differ = [i for i, o in enumerate(m.ours) if o.kept != (str(i) in kept_datatrove)]
    assert not differ, f"{len(differ)} of {args.docs} documents judged differently: {differ[:20]}"
    print(f"{'method':<12}{'seconds':>10}{'docs/s':>10}  every repeat (s)")
    for name, ts in m.seconds.items():
        print(f"{name:<12}{statistics.median(ts):>10.2f}{docs_s[name]:>10.1f}  "
              + " ".join(f"{t:.2f}" for t in ts))
    print("ray map overhead (one kept document per worker, actors warm): "
          + ", ".join(f"{n} workers {s:.2f} s" for n, s in m.map_overhead_s.items()))
    print(json.dumps({
        "bench": "clean", "docs": args.docs, "repeats": args.repeats, "chunks": args.chunks,
        **{f"{name.replace('-', '_')}_docs_s": round(v, 2) for name, v in docs_s.items()},
        "ratio_vs_datatrove": round(docs_s["ours"] / docs_s["datatrove"], 3),
        "ratio_cold_vs_datatrove": round(docs_s["ours-cold"] / docs_s["datatrove"], 3),
        "scaling_1_to_2_workers": round(docs_s["ray-2"] / docs_s["ray-1"], 3),
        "map_overhead_s": {str(n): round(s, 2) for n, s in m.map_overhead_s.items()},
        "seconds": {name: [round(t, 2) for t in ts] for name, ts in m.seconds.items()},
        "kept_ours": kept_ours, "kept_datatrove": len(m.datatrove_kept), **verdicts,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
