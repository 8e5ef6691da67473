"""Stage 1, collect+clean: raw crawl (Common Crawl, WARC/WET/JSONL/Parquet/text, or the offline
demo) → a clean, deduplicated, decontaminated training mix.

Funnel, each step a counted decision (funnel.json, review/ samples of what each step removed):
  read records (readers.py; non-documents skipped by type, corrupt input quarantined)
  → extract main text (trafilatura) and repair Unicode (ftfy)
  → URL block list → language ID → Gopher quality/repetition, FineWeb, C4 → PII scrub
    (cleaning.py) → benchmark decontamination (core/decontam.py), per record, in the work units
  → exact dedup on normalized text → model-based quality score (quality_model.py)
  → MinHash-LSH near-dedup (dedup.py) → per-source mixing (mixing.py)
  → `docs/part-%05d.jsonl.gz` with {"id", "text", "source", "url", "language"}.
Every record read ends kept, dropped with a reason or quarantined: funnel.json's `accounting`
(in = kept + dropped + quarantined, in total and per source; funnel.py) is checked before the
stage returns, and a gap fails it with the numbers (AccountingError).

Memory: the corpus-level steps hold no texts. Merging writes each kept document's output line to
a spool file (spool.py) and keeps a row of a `DocTable` (128-bit text hash, source, where its line
is, text bytes: numpy columns, 44 bytes a document); exact dedup sorts those hashes; the quality
model reads texts back in batches (its training sample is capped); near dedup runs on the engine
and spills to files (dedup.py), so the driver holds a flag a document and the candidate pairs;
the shards are written by copying lines (sizes: docs/benchmarks.md).

Parallelism and resume: one work unit per part of an input file (a file larger than `unit_mb`
splits into several: readers.split_file, computed on the engine as a WARC's needs a pass over it;
per chunk of demo packages; per Common Crawl file, which downloads inside its unit), mapped by the
injected engine. Each unit writes its events to `units/unit-<index>-<identity>.jsonl.gz` in out_dir
(the stage's partial dir; with the artifact store on a bucket, its place there, so Ray nodes share
no disk and another machine resumes them) when it finishes, named after what it read (source,
file, part), so a killed run redoes only unfinished units, even when a changed `unit_mb` or `num_workers` (not
hashed) plans different ones; Common Crawl files are deleted once their unit is done. Units are
merged in input order and the corpus-level steps are deterministic, so the output does not depend
on the engine, the worker count or the unit size.
"""
from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.decontam import DecontamConfig, DecontamIndex, build_index
from core.decontam import drop_reason as contamination_reason
from core.files import ensure_free_space, is_url, iter_jsonl, names_in, publish_file, remove_tree
from core.sources import file_size, parse_source
from core.stage import Engine, SerialEngine, StageResult, worker_dir
from tasks.collect import demo_crawl
from tasks.collect.cleaning import clean_document
from tasks.collect.common_crawl import (
    CommonCrawlSource,
    download,
    list_files,
    local_path,
)
from tasks.collect.config import DEDUP_INDEX_DIR, Config, NothingSurvived
from tasks.collect.dedup import DedupIndex, near_dedup
from tasks.collect.funnel import (
    NOT_IN_MIX,
    PREVIEW_CHARS,
    DocTable,
    Funnel,
    check_accounting,
    flatten,
    text_bytes,
)
from tasks.collect.mixing import mix_sizes
from tasks.collect.quality_model import (
    QualityConfig,
    cross_fit_scores,
    load_reference_texts,
    train_quality_model,
)
from tasks.collect.quality_model import drop_reason as quality_reason
from tasks.collect.readers import (
    WHOLE,
    Part,
    extract_text,
    read_file,
    resolve_source,
    split_file,
)
from tasks.collect.records import ReadEvent, Skipped, quarantine_record
from tasks.collect.spool import Spool

log = logging.getLogger("gristmill.collect")

DEMO_CHUNKS_PER_WORKER = 4  # several small units per worker balance uneven package sizes
UNITS_DIR, DOWNLOADS_DIR = "units", "downloads"
NEAR_DEDUP_DIR = "near_dedup"  # in out_dir: near dedup's spilled signatures, bucket rows and pairs
SPOOL_FILE = "kept.jsonl"  # in out_dir: the kept documents during the corpus-level steps


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


def document_event(item: ReadEvent, config: Config) -> dict[str, Any]:
    """One record's fate: {"reason": kept | dropped_* | skipped_* | error_*, "nbytes", ...}."""
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
    if text is None:
        return {"reason": "skipped_no_text", "nbytes": item.nbytes}
    outcome = clean_document(text, item.url, config)
    matches = contamination(outcome.text, config.decontam) if outcome.kept else []
    reason = contamination_reason(matches) if matches else outcome.reason
    event = {"reason": "kept" if reason is None else f"dropped_{reason}",
             "nbytes": item.nbytes, "text_bytes": text_bytes(text), "url": item.url,
             "language": outcome.language}
    if outcome.pii_counts:
        event["pii"] = outcome.pii_counts
    if matches:  # for decontamination.json: which items, in which document
        event["matches"] = [list(m) for m in matches]
        event["id"] = text_hash(outcome.text)[:8].hex()
    if reason is None:
        event["text"] = outcome.text
    else:
        event["preview"] = text[:PREVIEW_CHARS]
    return event


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


def process_unit(job: tuple[WorkUnit, str]) -> str:
    """Read, extract and clean one unit into its result file (a path or URL, put there whole once
    written); stops after `max_docs_per_source` extracted docs. Returns the result's location."""
    unit, result = job
    cap, n_extracted = unit.config.max_docs_per_source, 0
    # written whole first: beside the result on a disk, in this worker's temp dir for a URL
    tmp = Path(tempfile.mkstemp(suffix=".jsonl.gz.tmp")[1] if is_url(result) else f"{result}.tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as out:
        for item in _unit_records(unit):
            event = document_event(item, unit.config)
            out.write(json.dumps(event, ensure_ascii=False) + "\n")
            n_extracted += "text_bytes" in event
            if cap is not None and n_extracted >= cap:
                break
    publish_file(tmp, result)
    if unit.url is not None:  # the raw download is no longer needed once its events are saved
        Path(unit.path).unlink(missing_ok=True)
    return result


def run_units(units: list[WorkUnit], units_dir: str | Path, engine: Engine) -> list[str]:
    """Result files of every unit, computing only those not finished by an earlier attempt."""
    if not is_url(units_dir):
        Path(units_dir).mkdir(parents=True, exist_ok=True)
    results = [unit_result_path(units_dir, u) for u in units]
    done = names_in(str(units_dir))
    pending = [(u, r) for u, r in zip(units, results) if r.rsplit("/", 1)[-1] not in done]
    if len(pending) < len(units):
        log.info("collect: resuming, %d of %d units already done", len(units) - len(pending),
                 len(units))
    engine.map(process_unit, pending)
    return results


# ---------------------------------------------------------------- corpus-level steps

def text_hash(text: str) -> bytes:
    """sha256 of the text lowercased with whitespace collapsed: the exact-dedup key (its first 8
    bytes in hex are the document's id)."""
    return hashlib.sha256(" ".join(text.lower().split()).encode()).digest()


def merge(units: list[WorkUnit], results: list[str], config: Config, funnel: Funnel,
          spool: Spool, decontam: DecontamIndex | None = None) -> DocTable:
    """Fold unit events in input order into the funnel (and the documents the units checked for
    contamination into `decontam`'s report), capping extracted docs per source across its
    units, and spool the kept documents; then drop exact duplicates (the first occurrence wins),
    found by sorting the table's 128-bit text hashes. Returns the table of the distinct
    documents (the texts are not held)."""
    cap = config.max_docs_per_source
    try:
        for unit, result in zip(units, results):
            for event in iter_jsonl([result]):
                if cap is not None and funnel.source(unit.source)["docs_in"] >= cap:
                    break
                funnel.add_event(unit.source, event)
                if decontam is not None and (event["reason"] == "kept" or "matches" in event):
                    decontam.record(event.get("id", ""), [tuple(m) for m in event.get("matches", [])])
                if event["reason"] != "kept":
                    continue
                digest = text_hash(event["text"])
                spool.add({"id": digest[:8].hex(), "text": event["text"], "source": unit.source,
                           "url": event["url"], "language": event["language"]}, digest)
    finally:
        docs = spool.close()
    _quarantine_empty_sources(config.sources, funnel)
    first = first_occurrences(docs)
    for row in np.flatnonzero(~first).tolist():  # the first occurrence has the same id
        doc = spool.doc(docs, row)
        funnel.drop("exact_duplicates", doc, duplicate_of=doc["id"])
    return docs.take(first)


def first_occurrences(docs: DocTable) -> np.ndarray:
    """bool [n]: whether each row is the first with its 128-bit text hash."""
    order = np.lexsort((np.arange(len(docs)), docs.hash_lo, docs.hash_hi))
    hi, lo = docs.hash_hi[order], docs.hash_lo[order]
    first = np.zeros(len(docs), bool)
    first[order] = np.r_[True, (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])][:len(docs)]
    return first


def _quarantine_empty_sources(sources: list[str], funnel: Funnel) -> None:
    """A source that yielded no document (an empty or corrupt file, requests only) is counted as
    `error_source_without_documents` and quarantined with what it held; the other sources go on.
    Only when no source yields any is it an error, one line naming each source and why."""
    empty = {s: {k: v for k, v in sorted(funnel.source(s).items()) if k.startswith(("error_", "skipped_"))}
             for s in sources if funnel.source(s)["docs_in"] == 0}
    if len(empty) == len(sources):
        raise ValueError("no source yielded a document: " + "; ".join(
            f"{source!r} ({', '.join(f'{k} {v}' for k, v in why.items()) or 'nothing read'})"
            for source, why in empty.items()))
    for source, why in empty.items():
        log.warning("source %r yielded no documents (%s); quarantined, the other sources go on", source, why)
        funnel.counts["error_source_without_documents"] += 1
        funnel.source(source)["error_source_without_documents"] += 1
        funnel.quarantine.append({"reason": "error_source_without_documents", "where": source,
                                  "source": source, "sample": json.dumps(why)})


def apply_quality_model(docs: DocTable, spool: Spool, cfg: QualityConfig, out_dir: Path,
                        funnel: Funnel) -> tuple[DocTable, dict[str, float]]:
    """Train reference-vs-crawl, save the model, drop docs whose cross-fit score (from a model
    that did not train on them) is below the threshold."""
    positives = load_reference_texts(cfg.reference, cfg.max_train_docs, cfg.seed)
    crawl = spool.texts(docs)
    model, metrics = train_quality_model(positives, crawl, cfg)
    model.save(out_dir / "quality_model")
    keep = np.ones(len(docs), bool)
    for row, score in enumerate(cross_fit_scores(positives, crawl, cfg)):
        reason = quality_reason(float(score), cfg)
        if reason is not None:
            keep[row] = False
            funnel.drop(f"dropped_{reason}", spool.doc(docs, row), score=round(float(score), 4))
    return docs.take(keep), {f"quality_model_{k}": v for k, v in metrics.items()}


def apply_near_dedup(docs: DocTable, spool: Spool, config: Config, engine: Engine,
                     out_dir: Path, funnel: Funnel) -> tuple[DocTable, dict[str, int]]:
    index = None
    if config.dedup_index_from:
        index_dir = Path(config.dedup_index_from) / DEDUP_INDEX_DIR
        try:  # under the artifact store: the workers read its shards where the store keeps them
            location = worker_dir(engine, index_dir)
        except ValueError:
            location = str(index_dir)
        index = DedupIndex.load(index_dir, location)
    result = near_dedup(spool.texts(docs), config.dedup, engine, index, ids=docs.ids,
                        work_dir=worker_dir(engine, out_dir / NEAR_DEDUP_DIR),
                        index_dir=out_dir / DEDUP_INDEX_DIR)
    for row, survivor in zip(result.removed.tolist(), result.survivor):
        funnel.drop("near_duplicates", spool.doc(docs, row), duplicate_of=survivor)
    keep = np.ones(len(docs), bool)
    keep[result.removed] = False
    return docs.take(keep), \
        {f"near_dedup_{k}": v for k, v in result.counts().items()}


def write_shards(docs: DocTable, spool: Spool, docs_dir: Path, docs_per_shard: int) -> int:
    """docs/part-%05d.jsonl.gz, each document's line copied from the spool; gzip mtime fixed at
    0 so equal docs give byte-identical files."""
    if docs_dir.exists():  # left by an interrupted earlier attempt
        shutil.rmtree(docs_dir)
    docs_dir.mkdir(parents=True)
    n_shards = 0
    for n_shards, start in enumerate(range(0, len(docs), docs_per_shard), start=1):
        shard = docs.take(np.arange(start, min(start + docs_per_shard, len(docs))))
        ensure_free_space(docs_dir, int(shard.size.sum()), "a document shard")  # gzip only shrinks it
        with (open(docs_dir / f"part-{n_shards - 1:05d}.jsonl.gz", "wb") as raw,
              gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f):
            for line in spool.lines(shard):  # deflate's output does not depend on the pieces
                f.write(line)
    return n_shards


def run(config: Config, out_dir: Path, *, engine: Engine) -> StageResult:
    """Read and clean every source, then dedup, decontaminate and mix into out_dir/docs."""
    out_dir = Path(out_dir)
    units = plan_units(config, out_dir / DOWNLOADS_DIR, engine)
    log.info("collect: %d work units from %d sources", len(units), len(config.sources))
    funnel = Funnel(config.review_samples)
    units_dir = worker_dir(engine, out_dir / UNITS_DIR)
    results = run_units(units, units_dir, engine)
    spool = Spool(out_dir / SPOOL_FILE)
    decontam = build_index(config.decontam) if config.decontam.eval_sets else None  # for its report
    docs = merge(units, results, config, funnel, spool, decontam)
    spool.share(worker_dir(engine, out_dir / SPOOL_FILE))
    funnel.record_steps(decontaminated=decontam is not None)
    funnel.step_docs("exact_dedup", docs)
    stats: dict[str, Any] = {}
    if config.quality.enabled:
        docs, quality_stats = apply_quality_model(docs, spool, config.quality, out_dir, funnel)
        stats.update(quality_stats)
        funnel.step_docs("quality_model", docs)
    if config.near_dedup:
        docs, dedup_stats = apply_near_dedup(docs, spool, config, engine, out_dir, funnel)
        stats.update(dedup_stats)
        funnel.counts["near_duplicates"] = dedup_stats["near_dedup_near_duplicates"]
        funnel.step_docs("near_dedup", docs)
    if not docs:
        raise NothingSurvived("no documents survived the filters; loosen the filter thresholds")
    rows_of = {name: np.flatnonzero(docs.source == code) for code, name in enumerate(docs.sources)}
    rows_of = {name: rows for name, rows in rows_of.items() if len(rows)}
    names, picks, mix_record = mix_sizes({name: docs.text_bytes[rows] for name, rows in rows_of.items()},
                                         config.mix)
    rows = np.concatenate([np.zeros(0, np.int64)] + [rows_of[name] for name in names])
    starts = np.cumsum([0] + [len(rows_of[name]) for name in names])
    mixed = docs.take(rows[starts[picks[:, 0]] + picks[:, 1]])
    funnel.drop_missing(NOT_IN_MIX, docs, mixed, spool.doc)
    docs = mixed
    funnel.step_docs("mix", docs)
    (out_dir / "mix.json").write_text(json.dumps(mix_record, indent=2) + "\n")
    report = funnel.report()
    report["accounting"] = funnel.accounting(docs)
    report["shards"] = write_shards(docs, spool, out_dir / "docs", config.docs_per_shard)
    if decontam is not None:
        (out_dir / "decontamination.json").write_text(json.dumps(decontam.report(), indent=2) + "\n")
    (out_dir / "funnel.json").write_text(json.dumps(report, indent=2) + "\n")
    check_accounting(report["accounting"])  # after funnel.json, which shows where it went wrong
    artifacts = ["funnel.json", "mix.json", *funnel.write_review(out_dir / "review")]
    if config.decontam.eval_sets:
        artifacts.append("decontamination.json")
    for spill in (units_dir, worker_dir(engine, out_dir / NEAR_DEDUP_DIR), spool.readable_at):
        remove_tree(spill)  # the committed output is docs/; these only serve resume
    (out_dir / SPOOL_FILE).unlink(missing_ok=True)
    shutil.rmtree(out_dir / DOWNLOADS_DIR, ignore_errors=True)
    last = report["steps"][-1]
    log.info("collect: kept %d docs, %.2f MB (%s); records %s", last["docs"], last["bytes"] / 1e6,
             ", ".join(f"{s['step']} {s['docs']}" for s in report["steps"]),
             report["accounting"]["summary"])
    return StageResult(stats={**flatten(report), **stats, "docs_out": last["docs"],
                              "bytes_out": last["bytes"]}, artifacts=artifacts)
