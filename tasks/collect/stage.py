"""Stage 1, collect+clean: raw crawl (Common Crawl, WARC/WET/JSONL/Parquet/text, or the offline
demo) → a clean, deduplicated, decontaminated training mix.

Funnel, each step a counted decision (funnel.json, review/ samples of what each step removed):
  read records (read/readers.py; non-documents skipped by type, corrupt input quarantined)
  → extract main text (trafilatura) and repair Unicode (ftfy)
  → URL block list → language ID → Gopher quality/repetition, FineWeb, C4 → PII scrub
    (clean/cleaning.py) → benchmark decontamination (core/decontam.py) [→ the score of a
    quality model trained before, `quality.model`], per record, in the work units
  → exact dedup on normalized text → [model-based quality score of a model trained here on the
    crawl, out of fold (clean/quality_model.py)]
  → MinHash-LSH near-dedup (dedup/near.py) → per-source mixing (output/mixing.py)
  → `docs/part-%05d.jsonl.gz` with {"id", "text", "source", "url", "language"}.
Every record read ends kept, dropped with a reason or quarantined: funnel.json's `accounting`
(in = kept + dropped + quarantined, in total and per source; output/funnel.py) is checked before
the stage returns, and a gap fails it with the numbers (AccountingError).

Memory: the corpus-level steps hold no texts. Each work unit writes its kept documents' output
lines to a spool file of its own (output/spool.py) and its events say where; merging the events,
the stage keeps a row of a `DocTable` per kept document (128-bit text hash, source, spool file
and place, text bytes: numpy columns, 48 bytes a document). Exact dedup (dedup/exact_dedup.py),
the quality model's scoring and near dedup (dedup/near.py) run on the engine and spill to files
in out_dir, so the driver holds a flag or a score a document and the candidate pairs; the shards
are written on the engine by copying lines (sizes: docs/benchmarks.md).

This module plans and runs the work units (a record's whole path through the chain is
`document_events`) and merges their events; the corpus-level steps after the merge are
corpus.py's, run here in order.

Parallelism and resume: one work unit per part of an input file (a file larger than `unit_mb`
splits into several: readers.split_file, computed on the engine as a WARC's needs a pass over it;
per chunk of demo packages; per Common Crawl file, which downloads inside its unit), mapped by the
injected engine. Each unit writes its kept documents to `units/unit-<index>-<identity>.docs.jsonl`,
then its events to `units/unit-<index>-<identity>.jsonl.gz`, in out_dir (the stage's partial
dir; with the artifact store on a bucket, its place there, so Ray nodes share no disk and another
machine resumes them), named after what it read (source, file, part), so a killed run redoes only
unfinished units, even when a changed `unit_mb` or `num_workers` (not hashed) plans different
ones; Common Crawl files are deleted once their unit is done. The corpus-level steps on the engine
resume from their spilled files too. Units are merged in input order and the corpus-level steps
are deterministic, so the output does not depend on the engine, the worker count or the unit size.
"""
from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import logging
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from gristmill.core.clock import NO_CLOCK, StepClock
from gristmill.core.decontam import DecontamConfig, DecontamIndex, build_index
from gristmill.core.decontam import drop_reason as contamination_reason
from gristmill.core.files import (
    iter_jsonl,
    names_in,
    publish_file,
    remove_tree,
    staging_path,
)
from gristmill.core.sources import file_size, parse_source
from gristmill.core.stage import Engine, InputError, SerialEngine, StageResult, worker_dir
from gristmill.tasks.collect.clean.cleaning import clean_documents
from gristmill.tasks.collect.clean.quality_model import DROP_REASON as QUALITY_DROP
from gristmill.tasks.collect.clean.quality_model import (
    QualityModel,
    is_low_quality,
    load_model,
)
from gristmill.tasks.collect.config import Config, NothingSurvived
from gristmill.tasks.collect.corpus import (
    EXACT_DEDUP_DIR,
    GZIP_LEVEL,
    NEAR_DEDUP_DIR,
    QUALITY_DIR,
    apply_exact_dedup,
    apply_mix,
    apply_near_dedup,
    apply_quality_model,
    write_shards,
)
from gristmill.tasks.collect.output.funnel import PREVIEW_CHARS, Funnel, check_accounting, flatten
from gristmill.tasks.collect.output.spool import DocTable, SpoolWriter, TableBuilder, text_bytes
from gristmill.tasks.collect.read import demo_crawl
from gristmill.tasks.collect.read.common_crawl import (
    CommonCrawlSource,
    download,
    list_files,
    local_path,
)
from gristmill.tasks.collect.read.readers import (
    WHOLE,
    Part,
    extract_text,
    read_file,
    resolve_source,
    split_file,
)
from gristmill.tasks.collect.read.records import RawDoc, ReadEvent, Skipped, quarantine_record
from gristmill.tasks.collect.timing import Timing, load_worker

log = logging.getLogger("gristmill.collect")

DEMO_CHUNKS_PER_WORKER = 4  # several small units per worker balance uneven package sizes
UNITS_DIR, DOWNLOADS_DIR = "units", "downloads"
SPOOL_SUFFIX = ".docs.jsonl"  # beside a unit's events: its kept documents' output lines


# ---------------------------------------------------------------- work units (per part of a file)

@dataclass(frozen=True, kw_only=True)
class WorkUnit:
    """One picklable piece of work: a file (or part of one) of a source, or a chunk of demo
    packages."""

    config: Config
    source: str
    index: int = 0  # position in the plan: orders the result files
    path: str | None = None  # local path or fsspec URL
    part: Part = WHOLE  # the part of the file this unit reads
    size: int | None = None  # the file's size when the plan was made (None: downloaded first)
    url: str | None = None  # a remote file downloaded to `path` first ('cc:' sources)
    packages: tuple[tuple[str, str], ...] = ()


def _split(job: tuple[str, int]) -> list[Part]:
    return split_file(*job)


def _file_units(config: Config, text: str, engine: Engine) -> list[dict[str, Any]]:
    """A file source's files, each as one unit or, when larger than `unit_mb`, several."""
    sizes = {str(p): file_size(p) for p in resolve_source(text)}
    unit_bytes = max(1, round(config.unit_mb * 1_000_000))
    parts: dict[str, list[Part]] = {path: [WHOLE] for path in sizes}
    large = [path for path, size in sizes.items() if size > unit_bytes]
    if large:  # a WARC's parts need a pass over it: on the engine, not the driver
        parts.update(zip(large, engine.map(_split, [(path, unit_bytes) for path in large])))
    return [{"path": path, "part": part, "size": size} for path, size in sizes.items() for part in parts[path]]


def _source_units(config: Config, text: str, download_dir: Path, engine: Engine) -> list[dict[str, Any]]:
    source = parse_source(text)
    if source.kind == "demo":
        source.demo([demo_crawl.DEMO_NAME], "source")
        packages = demo_crawl.list_packages()
        n_chunks = max(1, min(len(packages), config.num_workers * DEMO_CHUNKS_PER_WORKER))
        bounds = [len(packages) * i // n_chunks for i in range(n_chunks + 1)]
        return [{"packages": tuple(packages[a:b])} for a, b in itertools.pairwise(bounds)]
    if source.kind == "cc":
        urls = list_files(CommonCrawlSource.parse(text), config.cc_base_url,
                          retries=config.download_retries, timeout_s=config.download_timeout_s)
        return [{"url": url, "path": str(local_path(url, download_dir))} for url in urls]
    return _file_units(config, text, engine)


def plan_units(config: Config, download_dir: Path, engine: Engine | None = None) -> list[WorkUnit]:
    """Work units in deterministic input order; ValueError naming a source that has no input.
    `engine` splits large files (default: in this process)."""
    units: list[WorkUnit] = []
    for source in config.sources:
        for fields in _source_units(config, source, download_dir, engine or SerialEngine()):
            units.append(WorkUnit(config=config, source=source, index=len(units), **fields))
    return units


def _unit_records(unit: WorkUnit) -> Iterator[ReadEvent]:
    if unit.path is None:
        return demo_crawl.iter_records(unit.packages)
    if unit.url is not None:
        download(unit.url, Path(unit.path), retries=unit.config.download_retries,
                 timeout_s=unit.config.download_timeout_s)
    return read_file(unit.path, max_doc_bytes=unit.config.max_doc_bytes, part=unit.part, planned_size=unit.size)


def _extracted(item: ReadEvent) -> str | dict[str, Any]:
    """The record's text, or its event when it has none (skipped, or quarantined)."""
    if isinstance(item, Skipped):
        event: dict[str, Any] = {"reason": item.reason, "nbytes": item.nbytes}
        if item.sample is not None:
            event["quarantine"] = quarantine_record(item)
        return event
    try:
        text = extract_text(item)
    except ImportError:  # a missing extractor dependency is a broken install, not a bad page
        raise
    except Exception as exc:  # one malformed page must not end the crawl; it is quarantined
        log.warning("text extraction failed for %s: %s", item.url, exc)
        return {"reason": "error_extraction", "nbytes": item.nbytes,
                "quarantine": {"reason": "error_extraction", "where": item.where,
                               "nbytes": item.nbytes, "sample": repr(exc)}}
    return {"reason": "skipped_no_text", "nbytes": item.nbytes} if text is None else text


def document_events(items: Sequence[ReadEvent], config: Config, clock: StepClock = NO_CLOCK) -> list[dict[str, Any]]:
    """Each record's fate, in order: {"reason": kept | dropped_* | skipped_* | error_*, "nbytes",
    ...}. Each step runs over the whole batch before the next (clean/cleaning.py says why);
    `clock` is charged each step's seconds (timing.py), the reading of the records since its
    last lap included."""
    extracted = [_extracted(item) for item in items]
    clock.lap("read_extract")
    at = [i for i, text in enumerate(extracted) if isinstance(text, str)]
    texts = cast(list[str], [extracted[i] for i in at])
    docs = cast(list[RawDoc], [items[i] for i in at])  # the records with a text
    outcomes = clean_documents([(text, doc.url) for text, doc in zip(texts, docs)], config, clock)
    matches = [contamination(o.text, config.decontam) if o.kept else [] for o in outcomes]
    reasons = [contamination_reason(m) if m else o.reason for o, m in zip(outcomes, matches)]
    clock.lap("decontamination")
    scores: dict[int, float] = {}  # position in `at` -> the score of a document the model dropped
    if config.quality.enabled and config.quality.model:  # a model trained before
        kept = [j for j, reason in enumerate(reasons) if reason is None]
        got = load_model(config.quality.model).score([outcomes[j].text for j in kept]) if kept else []
        for j, score, low in zip(kept, got, is_low_quality(np.asarray(got), config.quality)):
            if low:
                reasons[j], scores[j] = QUALITY_DROP, round(float(score), 4)
        clock.lap("quality_model")
    events = cast(list[dict[str, Any]], extracted)  # the records without text keep theirs
    for j, i in enumerate(at):
        text, outcome, reason = texts[j], outcomes[j], reasons[j]
        event = {"reason": "kept" if reason is None else f"dropped_{reason}",
                 "nbytes": docs[j].nbytes, "text_bytes": text_bytes(text), "url": docs[j].url,
                 "language": outcome.language}
        if j in scores:
            event["score"] = scores[j]
        if outcome.pii_counts:
            event["pii"] = outcome.pii_counts
        if matches[j]:  # for decontamination.json: which items, in which document
            event["matches"] = [list(m) for m in matches[j]]
            event["id"] = text_hash(outcome.text)[:8].hex()
        if reason is None:
            event["text"] = outcome.text
        else:
            event["preview"] = text[:PREVIEW_CHARS]
        events[i] = event
    return events


_DECONTAM_INDEXES: dict[str, DecontamIndex] = {}  # per process: built once, by the first unit


def contamination(text: str, cfg: DecontamConfig) -> list[tuple[str, str]]:
    """The benchmark items `text` overlaps (none when no eval sets are configured)."""
    if not cfg.eval_sets:
        return []
    key = cfg.model_dump_json()
    if key not in _DECONTAM_INDEXES:
        _DECONTAM_INDEXES[key] = build_index(cfg)
    return _DECONTAM_INDEXES[key].find(text)


def unit_result_path(units_dir: str | Path, unit: WorkUnit) -> str:
    """Named by the unit's place in the plan and a digest of what it reads, so a result is reused
    only by a unit that reads the same, whatever plan an earlier attempt had."""
    identity = json.dumps([unit.source, unit.path, unit.url, unit.part.start, unit.part.end,
                           unit.packages])
    return f"{units_dir}/unit-{unit.index:05d}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}.jsonl.gz"


def spool_path(result: str) -> str:
    """Where the unit whose events are at `result` writes its kept documents' lines."""
    return result.removesuffix(".jsonl.gz") + SPOOL_SUFFIX


# Records a unit reads before it runs them through the chain's steps one step at a time (the more,
# the longer a step's tables stay in the CPU's caches), fewer once their payloads pass BATCH_BYTES:
# a worker holds one batch, whatever its records' sizes (each is at most `max_doc_bytes`).
BATCH_RECORDS = 200
BATCH_BYTES = 16_000_000


def _batches(records: Iterator[ReadEvent]) -> Iterator[list[ReadEvent]]:
    batch: list[ReadEvent] = []
    size = 0
    for record in records:
        batch.append(record)
        size += record.nbytes
        if len(batch) == BATCH_RECORDS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch

TIMING = "timing"  # the key of a unit's last line: its seconds per step, and its process's cold start
_worker_loaded = False  # per process: load_worker has run


def process_unit(job: tuple[WorkUnit, str]) -> str:
    """Read, extract and clean one unit: its kept documents' output lines into its spool file,
    then every record's event (a kept one says where its line is, not its text) into its result
    file, which marks the unit done (each put where it belongs whole once written); stops after
    `max_docs_per_source` extracted docs. Returns the result's location."""
    unit, result = job
    global _worker_loaded
    cold_start = {} if _worker_loaded else load_worker()  # once per process, each part timed
    _worker_loaded = True
    cap, n_extracted, clock = unit.config.max_docs_per_source, 0, StepClock()
    events, lines = staging_path(result, ".tmp"), staging_path(spool_path(result), ".tmp")
    with gzip.open(events, "wt", compresslevel=GZIP_LEVEL, encoding="utf-8") as out, open(lines, "wb") as spool_file:
        spool = SpoolWriter(spool_file)
        clock.start()
        for batch in _batches(_unit_records(unit)):
            for event in document_events(batch, unit.config, clock):
                if "text" in event:  # kept: cleaned, so its size differs from `text_bytes` extracted
                    text = event.pop("text")
                    digest = text_hash(text)
                    event["offset"], event["size"] = spool.add(
                        {"id": digest[:8].hex(), "text": text, "source": unit.source,
                         "url": event["url"], "language": event["language"]})
                    event["hash"], event["kept_bytes"] = digest[:16].hex(), text_bytes(text)
                out.write(json.dumps(event, ensure_ascii=False) + "\n")
                n_extracted += "text_bytes" in event
                if cap is not None and n_extracted >= cap:
                    break
            clock.lap("write")
            if cap is not None and n_extracted >= cap:
                break
        out.write(json.dumps({TIMING: {"steps": clock.rounded(), "cold_start": cold_start}}) + "\n")
    publish_file(lines, spool_path(result))
    publish_file(events, result)  # last: marks the unit done
    if unit.url is not None and unit.path is not None:  # the raw download, no longer needed once its events are saved
        Path(unit.path).unlink(missing_ok=True)
    return result


def run_units(units: list[WorkUnit], units_dir: str | Path, engine: Engine) -> list[str]:
    """Result files of every unit, computing only those not finished by an earlier attempt."""
    results = [unit_result_path(units_dir, u) for u in units]
    done = names_in(str(units_dir), create=True)  # a spool file without its result is redone
    pending = [(u, r) for u, r in zip(units, results) if r.rsplit("/", 1)[-1] not in done]
    if len(pending) < len(units):
        log.info("collect: resuming, %d of %d units already done", len(units) - len(pending),
                 len(units))
    engine.map(process_unit, pending)
    return results


# ---------------------------------------------------------------- merging the units

def text_hash(text: str) -> bytes:
    """sha256 of the text lowercased with whitespace collapsed: the exact-dedup key (its first 8
    bytes in hex are the document's id)."""
    return hashlib.sha256(" ".join(text.lower().split()).encode()).digest()


def merge(units: list[WorkUnit], results: list[str], config: Config, funnel: Funnel,
          decontam: DecontamIndex | None = None, timing: Timing | None = None) -> DocTable:
    """Fold unit events in input order into the funnel (and the documents the units checked for
    contamination into `decontam`'s report), and their timing lines into `timing`, capping
    extracted docs per source across its units. Returns the table of the kept documents (their
    texts stay in the units' spool files)."""
    cap = config.max_docs_per_source
    table = TableBuilder()
    for file, (unit, result) in enumerate(zip(units, results)):
        capped = False
        for event in iter_jsonl([result]):
            if TIMING in event:
                if timing is not None:
                    timing.add_unit(event[TIMING])
                continue
            capped = capped or (cap is not None and funnel.source(unit.source)["docs_in"] >= cap)
            if capped:
                continue
            funnel.add_event(unit.source, event)
            if decontam is not None and (event["reason"] == "kept" or "matches" in event):
                decontam.record(event.get("id", ""), [tuple(m) for m in event.get("matches", [])])
            if event["reason"] == "kept":
                table.add(unit.source, bytes.fromhex(event["hash"]), file, event["offset"],
                          event["size"], event["kept_bytes"])
    _quarantine_empty_sources(config.sources, funnel)
    return table.table([spool_path(result) for result in results])


def _quarantine_empty_sources(sources: list[str], funnel: Funnel) -> None:
    """A source that yielded no document (an empty or corrupt file, requests only) is counted as
    `error_source_without_documents` and quarantined with what it held; the other sources go on.
    Only when no source yields any is it an error (InputError), one line naming each source and why."""
    empty = {s: {k: v for k, v in sorted(funnel.source(s).items()) if k.startswith(("error_", "skipped_"))}
             for s in sources if funnel.source(s)["docs_in"] == 0}
    if len(empty) == len(sources):
        raise InputError("no source yielded a document: " + "; ".join(
            f"{source!r} ({', '.join(f'{k} {v}' for k, v in why.items()) or 'nothing read'})"
            for source, why in empty.items()))
    for source, why in empty.items():
        log.warning("source %r yielded no documents (%s); quarantined, the other sources go on", source, why)
        funnel.counts["error_source_without_documents"] += 1
        funnel.source(source)["error_source_without_documents"] += 1
        funnel.quarantine.append({"reason": "error_source_without_documents", "where": source,
                                  "source": source, "sample": json.dumps(why)})


def run(config: Config, out_dir: Path, *, engine: Engine) -> StageResult:
    """Read and clean every source, then dedup, decontaminate and mix into out_dir/docs."""
    out_dir = Path(out_dir)
    load_model.cache_clear()  # in this process: a model saved anew at a place since an earlier run
    given_model = config.quality.model if config.quality.enabled else None
    scored_in_units = given_model is not None
    if given_model is not None:  # read here first: a missing model fails before any unit runs
        QualityModel.load(given_model).save(out_dir / "quality_model")  # what scored this
    units = plan_units(config, out_dir / DOWNLOADS_DIR, engine)
    log.info("collect: %d work units from %d sources", len(units), len(config.sources))
    funnel = Funnel(config.review_samples)
    units_dir = worker_dir(engine, out_dir / UNITS_DIR)
    results = run_units(units, units_dir, engine)
    timing = Timing()
    decontam = build_index(config.decontam) if config.decontam.eval_sets else None  # for its report
    docs = merge(units, results, config, funnel, decontam, timing)
    funnel.record_steps(decontaminated=decontam is not None, quality_scored=scored_in_units)
    clock = timing.corpus
    clock.lap("merge")
    docs = apply_exact_dedup(docs, config, engine, out_dir, funnel)
    funnel.step_docs("exact_dedup", docs)
    clock.lap("exact_dedup")
    stats: dict[str, Any] = {}
    if config.quality.enabled and not scored_in_units:
        docs, quality_stats = apply_quality_model(docs, config.quality, engine, out_dir, funnel)
        stats.update(quality_stats)
        funnel.step_docs("quality_model", docs)
        clock.lap("quality_model_trained_here")
    if config.near_dedup:
        docs, dedup_stats = apply_near_dedup(docs, config, engine, out_dir, funnel, clock)
        stats.update(dedup_stats)
        funnel.counts["near_duplicates"] = int(dedup_stats["near_dedup_near_duplicates"])
        funnel.step_docs("near_dedup", docs)
        clock.lap("near_dedup")
    if not docs:
        raise NothingSurvived("no documents survived the filters; loosen the filter thresholds")
    docs, mix_record = apply_mix(docs, config, funnel)
    funnel.step_docs("mix", docs)
    (out_dir / "mix.json").write_text(json.dumps(mix_record, indent=2) + "\n")
    report = funnel.report()
    report["accounting"] = funnel.accounting(docs)
    clock.lap("mix")
    report["shards"] = write_shards(docs, out_dir / "docs", config.docs_per_shard, engine)
    clock.lap("write_shards")
    if decontam is not None:
        (out_dir / "decontamination.json").write_text(json.dumps(decontam.report(), indent=2) + "\n")
    (out_dir / "funnel.json").write_text(json.dumps(report, indent=2) + "\n")
    check_accounting(report["accounting"])  # after funnel.json, which shows where it went wrong
    artifacts = ["funnel.json", "mix.json", *funnel.write_review(out_dir / "review")]
    if config.decontam.eval_sets:
        artifacts.append("decontamination.json")
    for spill_dir in (UNITS_DIR, EXACT_DEDUP_DIR, QUALITY_DIR, NEAR_DEDUP_DIR):
        remove_tree(worker_dir(engine, out_dir / spill_dir))  # the output is docs/; these serve resume
    shutil.rmtree(out_dir / DOWNLOADS_DIR, ignore_errors=True)
    last = report["steps"][-1]
    log.info("collect: kept %d docs, %.2f MB (%s); records %s", last["docs"], last["bytes"] / 1e6,
             ", ".join(f"{s['step']} {s['docs']}" for s in report["steps"]),
             report["accounting"]["summary"])
    return StageResult(stats={**flatten(report), **stats, "docs_out": last["docs"], "bytes_out": last["bytes"]},
                       artifacts=artifacts, measured=timing.stats())
