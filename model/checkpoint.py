"""Where training checkpoints live and how they are written, found and verified; shared by the
training loop (model/loop.py, via model/train_state.py) and PPO (model/ppo.py).

A checkpoint's place is a `Place`, built once where a training stage starts and passed to the
trainer: `checkpoint_place(work_dir, store_mapping)` gives a `LocalPlace` (the work directory's own
disk, model/checkpoint_local.py) or, when `store_mapping` maps a folder above the work directory
onto a bucket, a `BucketPlace`. The callers only ever see local directories: a checkpoint is
written into one and read from one; the place puts them where they belong. What every process of
a run does together (save, resume, find the newest good checkpoint) is this module's functions;
what one process does (list, rewrite a marker, remove) is the place's own methods.

On the local disk:

    <work_dir>/checkpoints/step-0000050/   one complete checkpoint
        ...                                what the trainer wrote (safetensors weights, tensors, JSON)
        metrics.jsonl                      the metrics rows written before it (a run resumed on
                                           another node's disk gets them back: `restore_rows`)
        checkpoint.json                    the loop state and every file's size and sha256;
                                           written last: the completion marker

A checkpoint is written into `tmp-step-*` and renamed once its marker is in place, so a crash or a
full disk mid-write leaves the previous checkpoints as they were and a directory without a marker,
which the next run deletes. Free space is checked before writing. Only the newest `keep` complete
checkpoints stay: with the loop's step-0 rollback anchor that is still `keep` directories, since
the anchor is the oldest and goes first. On resume each checkpoint is verified against its
digests, newest first; a damaged one (flipped or truncated bytes) is reported and deleted, and the
one before it is used.

A work directory that maps onto the artifact store's bucket (`GRISTMILL_STORE=s3://...`, so that a
training stage's ranks on nodes that share nothing but the bucket, or a run restarted on another
node, resume from the same checkpoints) has a `BucketPlace` (model/checkpoint_bucket.py, whose
docstring lays out the checkpoints there): the same files and marker, the marker uploaded last, by
rank 0, as the commit; a resume reads a local view of the files, fetched through this node's
object cache.

Which work directories map to the bucket is a `StoreMapping` (the artifact store's local root and
its bucket URL, `ArtifactStore.store_mapping`), handed to the training stage by whoever runs it: the
pipeline in its own process, or each launched rank from the store it opens (a Ray Train worker's
node has a local root of its own). A work directory under `root` keeps its checkpoints at `url` +
its path below `root` + `/checkpoints`; any other, or no mapping (None), keeps them on the local
disk.

Each save returns `{"checkpoint_s": seconds, "checkpoint_bytes": bytes}` (writing and uploading;
the bytes of every rank's files, the marker and the metrics copy aside; known to rank 0). The
trainers log them in the checkpoint step's metrics row, written after the checkpoint; the row is
saved in the marker too (`ROW_KEY`), and `restore_rows` writes it on resume when a stop came
between the two.
Fault points (core/faults.py): `checkpoint-files:<step>` once every file is in place but before
the marker, `checkpoint:<step>` once the checkpoint is complete.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gristmill.core.stage import MetricsLog, read_metrics
from gristmill.model.checkpoint_bucket import BucketPlace
from gristmill.model.checkpoint_files import Barrier, WriteFn, damage, gather, read_marker
from gristmill.model.checkpoint_local import LocalPlace

# what the trainers, stages and tests import from here (`damage` and `read_marker` live with the marker)
__all__ = [
    "CHECKPOINTS_DIR",
    "CHECKPOINT_STATS",
    "ROW_KEY",
    "Place",
    "StoreMapping",
    "checkpoint_place",
    "checkpoint_stats",
    "damage",
    "latest_good_checkpoint",
    "read_marker",
    "restore_rows",
    "resume_point",
    "save_checkpoint",
]

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_STATS = ("checkpoint_s", "checkpoint_bytes", "checkpoints")  # what checkpoint_stats summarises
METRICS_COPY = "metrics.jsonl"  # in a checkpoint: the metrics rows written before it (`restore_rows`)
ROW_KEY = "metrics_row"  # in a saved state: the metrics row of its step (`restore_rows`)


class Place(Protocol):
    """Where one work directory's checkpoints live; every path it returns is a local directory.
    `latest_good` is this process's answer (the run's is `latest_good_checkpoint`); `rewrite_marker`
    and `remove` are the main process's to call."""

    def complete(self) -> list[tuple[int, Path]]: ...
    def latest_good(self, main: bool) -> tuple[int, Path] | None: ...
    def at(self, step: int) -> Path: ...
    def clear_partial(self) -> None: ...
    def save(self, state: dict[str, Any], keep: int, write: WriteFn, expected_bytes: int, main: bool,
             barrier: Barrier) -> int: ...
    def rewrite_marker(self, path: Path, state: dict[str, Any]) -> None: ...
    def remove(self) -> None: ...


@dataclass(frozen=True)
class StoreMapping:
    """The artifact store's local copy of a bucket: the folder `root` holds what lies at `url`."""

    root: Path
    url: str


def checkpoint_place(work_dir: Path, store_mapping: StoreMapping | None) -> Place:
    """The place of `work_dir`'s checkpoints: on the bucket when `store_mapping` maps a folder above
    it there, else under `work_dir/checkpoints`."""
    work_dir = Path(work_dir)
    if store_mapping is not None:
        below = os.path.relpath(work_dir.resolve(), Path(store_mapping.root).resolve())
        if below != ".." and not below.startswith("../"):
            url = store_mapping.url.rstrip("/") + ("" if below == "." else "/" + Path(below).as_posix())
            return BucketPlace(work_dir / CHECKPOINTS_DIR, f"{url}/{CHECKPOINTS_DIR}")
    return LocalPlace(work_dir / CHECKPOINTS_DIR)


# ---------------------------------------------------------------- the functions the trainers call

def latest_good_checkpoint(place: Place, main: bool = True) -> tuple[int, Path] | None:
    """The newest complete checkpoint that verifies, as a local directory; damaged newer ones are
    logged and, by the main process, deleted. Every process of the run gets the same one: the
    oldest of their answers, which differ only when a node's cache holds the right bytes of an
    object that another node finds truncated on the bucket; then all of them take the one before it."""
    good = place.latest_good(main)
    agreed = min(gather(good[0] if good is not None else -1))
    if agreed < 0:
        return None
    return good if good is not None and good[0] == agreed else (agreed, place.at(agreed))


def resume_point(place: Place, *, main: bool = True, barrier: Barrier = lambda: None) -> tuple[int, Path] | None:
    """Where a (re)started training run resumes: the newest complete checkpoint that verifies,
    once the main process has removed what a crash left half-written; None to start afresh.
    Every process of a distributed run calls it and gets the same answer (`barrier` syncs them)."""
    if main:
        place.clear_partial()
    barrier()
    good = latest_good_checkpoint(place, main)
    barrier()
    return good


def save_checkpoint(place: Place, state: dict[str, Any], keep: int, write: WriteFn, *,
                    expected_bytes: int = 0, main: bool = True, barrier: Barrier = lambda: None,
                    metrics: MetricsLog | None = None) -> dict[str, float]:
    """Write checkpoint `state["step"]`: `write(directory)` fills a local directory (in every
    process of a distributed run; `barrier` syncs them), then the main process adds a copy of the
    metrics written so far (`metrics`, for `restore_rows`) and the marker with every file's digest
    last, and deletes all but the newest `keep` complete checkpoints. Needs free space for the last
    checkpoint's size (or `expected_bytes` for the first); a write that fails leaves the other
    checkpoints intact. Returns checkpoint_s and checkpoint_bytes."""
    copied = [0]  # the metrics copy's bytes: not the trainer's state, and they vary with its timings

    def write_with_metrics(directory: Path) -> None:
        write(directory)
        if main and metrics is not None and metrics.path.is_file():
            shutil.copyfile(metrics.path, directory / METRICS_COPY)
            copied[0] = (directory / METRICS_COPY).stat().st_size

    started = time.perf_counter()
    written = place.save(state, keep, write_with_metrics, expected_bytes, main, barrier)
    written -= copied[0]
    return {"checkpoint_s": round(time.perf_counter() - started, 4), "checkpoint_bytes": written}


def checkpoint_stats(saves: list[dict[str, float]]) -> dict[str, float]:
    """The stats of this invocation's checkpoints: checkpoint_s (mean seconds each), checkpoint_bytes
    (the last one's size) and checkpoints (how many); none when it wrote none."""
    if not saves:
        return {}
    return {"checkpoint_s": sum(s["checkpoint_s"] for s in saves) / len(saves),
            "checkpoint_bytes": saves[-1]["checkpoint_bytes"], "checkpoints": len(saves)}


def restore_rows(metrics: MetricsLog, step: int, state: dict[str, Any], path: Path) -> None:
    """After resuming from checkpoint `step` (at `path`): every metrics row up to it. Rows written
    on another node's disk (a run resumed on a fresh node, its rank 0 elsewhere before) come from
    the checkpoint's copy of the metrics (METRICS_COPY); the step's own row, written after the
    checkpoint with its seconds and bytes, from the saved state (`ROW_KEY`) when the run stopped
    before writing it."""
    rows = [r for r in read_metrics(metrics.path) if r["step"] <= step]
    saved = [r for r in read_metrics(Path(path) / METRICS_COPY) if r["step"] <= step]
    if len(saved) > len(rows):
        metrics.path.write_text("".join(json.dumps(r) + "\n" for r in saved))
    row = state.get(ROW_KEY)
    if row and not any(r.get("step") == step for r in read_metrics(metrics.path)):
        metrics.log(step, **row)
