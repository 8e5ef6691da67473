"""The collect stage's corpus-level steps, after its work units are merged into a `DocTable` of
the kept documents (their texts stay in the units' spool files): exact dedup, the quality model
trained here, near dedup, the mix, and the docs shards. Each runs on the engine and spills to
files in out_dir (kept for a resumed run, removed by `stage.run` once the shards are written),
drops rows of the table with a counted reason in the funnel, and returns the table that is left.
"""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from gristmill.core.clock import NO_CLOCK, StepClock
from gristmill.core.files import ensure_free_space, fetch_file, publish_file, remove_tree, staging_path
from gristmill.core.stage import Engine, worker_dir
from gristmill.tasks.collect.clean.quality_model import DROP_REASON as QUALITY_DROP
from gristmill.tasks.collect.clean.quality_model import (
    QualityConfig,
    cross_fit_scores,
    is_low_quality,
    load_reference_texts,
    train_quality_model,
)
from gristmill.tasks.collect.config import DEDUP_INDEX_DIR, Config
from gristmill.tasks.collect.dedup.exact_dedup import first_occurrences
from gristmill.tasks.collect.dedup.index import DedupIndex
from gristmill.tasks.collect.dedup.near import near_dedup
from gristmill.tasks.collect.output.funnel import NOT_IN_MIX, Funnel
from gristmill.tasks.collect.output.mixing import mix_sizes
from gristmill.tasks.collect.output.spool import DocTable
from gristmill.tasks.collect.read.texts import Texts

# in out_dir, spilled files of the corpus-level steps on the engine (kept for a resumed run)
EXACT_DEDUP_DIR, QUALITY_DIR, NEAR_DEDUP_DIR = "exact_dedup", "quality", "near_dedup"
# zlib's default level for the shards and the units' events: level 9 (gzip's) costs more CPU for
# a file barely smaller (docs/benchmarks.md)
GZIP_LEVEL = 6


def apply_exact_dedup(docs: DocTable, config: Config, engine: Engine, out_dir: Path,
                      funnel: Funnel) -> DocTable:
    """Drop exact duplicates: the first occurrence of each text hash wins (dedup/exact_dedup.py)."""
    first = first_occurrences(docs.hash_hi, docs.hash_lo, engine,
                              worker_dir(engine, out_dir / EXACT_DEDUP_DIR), config.dedup.partition_mb)
    rows = np.flatnonzero(~first)
    funnel.drop_rows("exact_duplicates", docs, rows,
                     lambda i: {"duplicate_of": docs.id(rows[i])})  # the first has the same id
    return docs.take(first)

def apply_quality_model(docs: DocTable, cfg: QualityConfig, engine: Engine, out_dir: Path,
                        funnel: Funnel) -> tuple[DocTable, dict[str, float]]:
    """Train reference-vs-crawl, save the model, drop docs whose cross-fit score (from a model
    that did not train on them, scored on the engine) is below the threshold."""
    positives = load_reference_texts(cfg.reference, cfg.max_train_docs, cfg.seed)
    crawl = docs.texts()
    model, metrics = train_quality_model(positives, crawl, cfg)
    model.save(out_dir / "quality_model")
    scores = cross_fit_scores(positives, crawl, cfg, engine=engine,
                              work_dir=worker_dir(engine, out_dir / QUALITY_DIR))
    low = is_low_quality(scores, cfg)
    rows = np.flatnonzero(low)
    funnel.drop_rows(f"dropped_{QUALITY_DROP}", docs, rows,
                     lambda i: {"score": round(float(scores[rows[i]]), 4)})
    return docs.take(~low), {f"quality_model_{k}": v for k, v in metrics.items()}

def apply_near_dedup(docs: DocTable, config: Config, engine: Engine, out_dir: Path,
                     funnel: Funnel, clock: StepClock = NO_CLOCK) -> tuple[DocTable, dict[str, float]]:
    index = None
    if config.dedup_index_from:
        index_dir = Path(config.dedup_index_from) / DEDUP_INDEX_DIR
        try:  # under the artifact store: the workers read its shards where the store keeps them
            location = worker_dir(engine, index_dir)
        except ValueError:
            location = str(index_dir)
        index = DedupIndex.load(index_dir, location)
    result = near_dedup(docs.texts(), config.dedup, engine, index, ids=docs.ids,
                        work_dir=worker_dir(engine, out_dir / NEAR_DEDUP_DIR),
                        index_dir=out_dir / DEDUP_INDEX_DIR, clock=clock)
    funnel.drop_rows("near_duplicates", docs, result.removed,
                     lambda i: {"duplicate_of": result.survivor[i]})
    keep = np.ones(len(docs), bool)
    keep[result.removed] = False
    return docs.take(keep), {f"near_dedup_{k}": v for k, v in result.counts().items()}


def apply_mix(docs: DocTable, config: Config, funnel: Funnel) -> tuple[DocTable, dict[str, Any]]:
    """The mix's documents in order (output/mixing.py; a document may repeat); the ones it did not take
    are dropped as not in the mix."""
    rows_of = {name: np.flatnonzero(docs.source == code) for code, name in enumerate(docs.sources)}
    rows_of = {name: rows for name, rows in rows_of.items() if len(rows)}
    names, picks, record = mix_sizes({name: docs.text_bytes[rows] for name, rows in rows_of.items()},
                                     config.mix)
    rows = np.concatenate([np.zeros(0, np.int64)] + [rows_of[name] for name in names])
    starts = np.cumsum([0] + [len(rows_of[name]) for name in names])
    del rows_of
    rows = rows[starts[picks[:, 0]] + picks[:, 1]]
    taken = np.zeros(len(docs), bool)
    taken[rows] = True
    funnel.drop_rows(NOT_IN_MIX, docs, np.flatnonzero(~taken))
    return docs.take(rows), record

def _shard_task(item: tuple[Texts, str]) -> str:
    """Write one docs shard by copying its documents' lines; gzip mtime fixed at 0 so equal docs
    give byte-identical files."""
    lines, location = item
    tmp = staging_path(location, ".tmp")
    ensure_free_space(tmp.parent, int(lines.sizes.sum()), "a document shard")  # gzip only shrinks it
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                   compresslevel=GZIP_LEVEL) as f:
        for line in lines.lines():  # deflate's output does not depend on the pieces
            f.write(line)
    publish_file(tmp, location)
    return location

def write_shards(docs: DocTable, docs_dir: Path, docs_per_shard: int, engine: Engine) -> int:
    """docs/part-%05d.jsonl.gz, `docs_per_shard` documents each, written on the engine (to the
    folder's place on the bucket when the workers share no disk with this machine, then fetched)."""
    if docs_dir.exists():  # left by an interrupted earlier attempt
        shutil.rmtree(docs_dir)
    docs_dir.mkdir(parents=True)
    location = worker_dir(engine, docs_dir)
    starts = range(0, len(docs), docs_per_shard)
    written = engine.map(_shard_task, [
        (docs.take(np.arange(start, min(start + docs_per_shard, len(docs)))).texts(),
         f"{location}/part-{k:05d}.jsonl.gz") for k, start in enumerate(starts)])
    if location != str(docs_dir):
        for shard in written:
            fetch_file(shard, docs_dir / shard.rsplit("/", 1)[-1])
        remove_tree(location)
    return len(written)
