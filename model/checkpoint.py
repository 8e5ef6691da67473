"""Where training checkpoints live and how they are written, found and verified; shared by the
training loop (model/loop.py, via model/train_state.py) and PPO (model/ppo.py).

A checkpoint's place is a `Place`: `checkpoint_place(work_dir)` gives a `LocalPlace` (the work
directory's own disk) or, when the work directory lies in the artifact store's local copy of a
bucket, a `BucketPlace`. The callers only ever see local directories: a checkpoint is written
into one and read from one; the place puts them where they belong.

On the local disk:

    <work_dir>/checkpoints/step-0000050/   one complete checkpoint
        ...                                what the trainer wrote (safetensors weights, tensors, JSON)
        checkpoint.json                    the loop state and every file's size and sha256;
                                           written last: the completion marker

A checkpoint is written into `tmp-step-*` and renamed once its marker is in place, so a crash or a
full disk mid-write leaves the previous checkpoints as they were and a directory without a marker,
which the next run deletes. Free space is checked before writing. Only the newest `keep` complete
checkpoints stay: with the loop's step-0 rollback anchor that is still `keep` directories, since
the anchor is the oldest and goes first. On resume each checkpoint is verified against its
digests, newest first; a damaged one (flipped or truncated bytes) is reported and deleted, and the
one before it is used.

On a bucket (`GRISTMILL_STORE=s3://...`, so that a training stage's ranks on nodes that share
nothing but the bucket, or a run restarted on another node, resume from the same checkpoints):

    <url of work_dir>/checkpoints/step-0000050/<files>            uploaded by the ranks that wrote them
    <url of work_dir>/checkpoints/step-0000050/checkpoint.json    uploaded last, by rank 0

Every rank writes its share into a staging folder of its own, uploads the files it wrote (rank 0's
gathered weights, or each rank's FSDP shard and RNG state), and sends their sizes and digests to
rank 0, which uploads the marker listing all of them once every rank has; no object store has a
rename, so the marker object is the commit. Older checkpoints beyond `keep` are deleted marker
first, so none is ever complete with files missing. Resume (any rank, any node) lists the markers,
newest first, fetches the files through this node's object cache (core/cache.py: bounded, least
recently used evicted, verified against the marker's sizes and digests) and hard-links them into a
local view, `<work_dir>/checkpoints/step-0000050.view-<pid>/`, which the loaders read as they
would a local checkpoint. A checkpoint with an object missing, truncated or changed is reported
in one line naming its URL and skipped (and deleted by rank 0) for the one before it; an upload
that fails (the bucket unreachable after retries, credentials refused, the bucket gone) fails the
run in one line naming the object, and leaves no marker, so the next run resumes from the last
complete checkpoint.

Which work directories map to the bucket is set by the process that runs the stage:
`GRISTMILL_CHECKPOINT_STORE` holds JSON `{"root": <local folder>, "url": <its URL>}` (the artifact
store's local root and bucket, `ArtifactStore.checkpoint_env`; a launcher whose ranks see another
local root, e.g. Ray Train workers on private disks, sets their own). A work directory under
`root` keeps its checkpoints at `url` + its path below `root` + `/checkpoints`; any other, or no
variable, keeps them on the local disk exactly as before.

Each save returns `{"checkpoint_s": seconds, "checkpoint_bytes": bytes}` (writing and uploading;
the bytes of every rank's files, the marker aside; known to rank 0). The trainers log them in the
checkpoint step's metrics row, written after the checkpoint; the row is saved in the marker too
(`ROW_KEY`), and `restore_row` writes it on resume when a stop came between the two.
Fault points (core/faults.py): `checkpoint-files:<step>` once every file is in place but before
the marker, `checkpoint:<step>` once the checkpoint is complete.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from core.cache import BucketError, ObjectCache, ObjectDamaged, link_into, on_bucket
from core.faults import fault_point
from core.files import DiskSpaceError, describe_files, ensure_free_space, file_digest
from core.stage import MetricsLog, read_metrics

MARKER = "checkpoint.json"  # written last inside a checkpoint: its completion marker
CHECKPOINTS_DIR = "checkpoints"
FILES_KEY = "files"  # in the marker: relative path -> {"bytes", "sha256"}
CHECKPOINT_STATS = ("checkpoint_s", "checkpoint_bytes", "checkpoints")  # what checkpoint_stats summarises
ROW_KEY = "metrics_row"  # in a saved state: the metrics row of its step (`restore_row`)
STORE_ENV = "GRISTMILL_CHECKPOINT_STORE"  # {"root": local folder, "url": its place on a bucket}
log = logging.getLogger("gristmill.checkpoint")

Barrier = Callable[[], None]
WriteFn = Callable[[Path], None]


def _step_name(step: int) -> str:
    return f"step-{step:07d}"


class Place(Protocol):
    """Where one work directory's checkpoints live; every path it returns is a local directory."""

    def complete(self) -> list[tuple[int, Path]]: ...
    def latest_good(self, main: bool) -> tuple[int, Path] | None: ...
    def at(self, step: int) -> Path: ...
    def clear_partial(self) -> None: ...
    def save(self, state: dict[str, Any], keep: int, write: WriteFn, expected_bytes: int, main: bool,
             barrier: Barrier) -> int: ...
    def rewrite_marker(self, path: Path, state: dict[str, Any]) -> None: ...
    def remove(self) -> None: ...


def checkpoint_place(work_dir: Path) -> Place:
    """The place of `work_dir`'s checkpoints: on the bucket when `$GRISTMILL_CHECKPOINT_STORE` maps a
    folder above it there, else under `work_dir/checkpoints`."""
    work_dir = Path(work_dir)
    if mapping := os.environ.get(STORE_ENV):
        store = json.loads(mapping)
        below = os.path.relpath(work_dir.resolve(), Path(store["root"]).resolve())
        if below != ".." and not below.startswith("../"):
            url = store["url"].rstrip("/") + ("" if below == "." else "/" + Path(below).as_posix())
            return BucketPlace(work_dir / CHECKPOINTS_DIR, f"{url}/{CHECKPOINTS_DIR}")
    return LocalPlace(work_dir / CHECKPOINTS_DIR)


def store_env(root: Path, url: str) -> dict[str, str]:
    """The environment that maps work directories under `root` onto `url` (see the module doc)."""
    return {STORE_ENV: json.dumps({"root": str(Path(root).resolve()), "url": url})}


# ---------------------------------------------------------------- the functions the trainers call

def complete_checkpoints(work_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with their marker), oldest first: (step, where it is or would be
    read locally)."""
    return checkpoint_place(work_dir).complete()


def latest_good_checkpoint(work_dir: Path, main: bool = True) -> tuple[int, Path] | None:
    """The newest complete checkpoint that verifies, as a local directory; damaged newer ones are
    logged and, by the main process, deleted (every process reaches the same verdict on the same files)."""
    return _agreed(checkpoint_place(work_dir), main)


def _agreed(place: Place, main: bool) -> tuple[int, Path] | None:
    """The newest good checkpoint as every process of the run sees it: the oldest of their answers.
    They differ only when a node's cache holds the right bytes of an object that another node
    finds truncated on the bucket; then all of them take the one before it."""
    good = place.latest_good(main)
    agreed = min(_gather(good[0] if good is not None else -1))
    if agreed < 0:
        return None
    return good if good is not None and good[0] == agreed else (agreed, place.at(agreed))


def resume_point(work_dir: Path, *, main: bool = True, barrier: Barrier = lambda: None) -> tuple[int, Path] | None:
    """Where a (re)started training run resumes: the newest complete checkpoint that verifies,
    once the main process has removed what a crash left half-written; None to start afresh.
    Every process of a distributed run calls it and gets the same answer (`barrier` syncs them)."""
    place = checkpoint_place(work_dir)
    if main:
        place.clear_partial()
    barrier()
    good = _agreed(place, main)
    barrier()
    return good


def save_checkpoint(work_dir: Path, state: dict[str, Any], keep: int, write: WriteFn, *,
                    expected_bytes: int = 0, main: bool = True, barrier: Barrier = lambda: None) -> dict[str, float]:
    """Write checkpoint `state["step"]`: `write(directory)` fills a local directory (in every
    process of a distributed run; `barrier` syncs them), then the main process adds the marker with
    every file's digest last and deletes all but the newest `keep` complete checkpoints. Needs free
    space for the last checkpoint's size (or `expected_bytes` for the first); a write that fails
    leaves the other checkpoints intact. Returns checkpoint_s and checkpoint_bytes."""
    started = time.perf_counter()
    written = checkpoint_place(work_dir).save(state, keep, write, expected_bytes, main, barrier)
    return {"checkpoint_s": round(time.perf_counter() - started, 4), "checkpoint_bytes": written}


def checkpoint_stats(saves: list[dict[str, float]]) -> dict[str, float]:
    """The stats of this invocation's checkpoints: checkpoint_s (mean seconds each), checkpoint_bytes
    (the last one's size) and checkpoints (how many); none when it wrote none."""
    if not saves:
        return {}
    return {"checkpoint_s": sum(s["checkpoint_s"] for s in saves) / len(saves),
            "checkpoint_bytes": saves[-1]["checkpoint_bytes"], "checkpoints": len(saves)}


def restore_row(metrics: MetricsLog, step: int, state: dict[str, Any]) -> None:
    """After resuming from checkpoint `step`: its step's metrics row (`ROW_KEY` of the saved state),
    when the run stopped after the checkpoint but before writing that row (the trainers write it
    after the checkpoint, with the checkpoint's seconds and bytes)."""
    row = state.get(ROW_KEY)
    if row and not any(r.get("step") == step for r in read_metrics(metrics.path)):
        metrics.log(step, **row)


def read_marker(path: Path) -> dict[str, Any]:
    """The loop state saved with a (local) checkpoint."""
    marker = json.loads((Path(path) / MARKER).read_text())
    marker.pop(FILES_KEY, None)
    return marker


def rewrite_marker(work_dir: Path, path: Path, state: dict[str, Any]) -> None:
    """Replace a checkpoint's loop state atomically, keeping its file digests (the checkpoint
    stays complete throughout)."""
    checkpoint_place(work_dir).rewrite_marker(path, state)


def damage(path: Path) -> str | None:
    """Why a complete local checkpoint cannot be trusted (a file missing, truncated or changed), or None."""
    files = json.loads((Path(path) / MARKER).read_text()).get(FILES_KEY)
    for name, expected in (files or {}).items():
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, {expected['bytes']} were written"
        if file_digest(file) != expected["sha256"]:
            return f"{name} does not match its sha256"
    return None


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def clear_partial_checkpoints(work_dir: Path) -> None:
    """Remove temporary and unmarked checkpoints left by a crash."""
    checkpoint_place(work_dir).clear_partial()


def remove_checkpoints(work_dir: Path) -> None:
    """Delete all checkpoints once a stage's outputs are exported (they are several times the
    model's size and only serve a resume)."""
    checkpoint_place(work_dir).remove()


def _marker_text(state: dict[str, Any], files: dict[str, Any]) -> str:
    return json.dumps({**state, FILES_KEY: files}) + "\n"


def _replace_marker(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a local checkpoint's marker with `state`, atomically; returns its file records."""
    files = json.loads((Path(path) / MARKER).read_text()).get(FILES_KEY, {})
    tmp = Path(path) / (MARKER + ".tmp")
    tmp.write_text(_marker_text(state, files))
    os.replace(tmp, Path(path) / MARKER)
    return files


def _disk_full(error: OSError, where: Path) -> OSError:
    if error.errno == errno.ENOSPC:
        return DiskSpaceError(errno.ENOSPC, f"disk full while writing a checkpoint to {where} "
                                            f"({error}); the earlier checkpoints are intact")
    return error


# ---------------------------------------------------------------- on this machine's disk

class LocalPlace:
    """Checkpoints under `root` (`<work_dir>/checkpoints`), written aside and renamed when complete."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def complete(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.root.glob("step-*") if self.root.is_dir() else []:
            if path.is_dir() and (path / MARKER).is_file():
                found.append((read_marker(path)["step"], path))
        return sorted(found)

    def latest_good(self, main: bool) -> tuple[int, Path] | None:
        for step, path in reversed(self.complete()):
            reason = damage(path)
            if reason is None:
                return step, path
            log.warning("checkpoint %s is damaged (%s); falling back to the one before it", path, reason)
            if main:
                shutil.rmtree(path, ignore_errors=True)
        return None

    def at(self, step: int) -> Path:
        """Complete checkpoint `step`, verified; OSError when it is not there or damaged."""
        path = self.root / _step_name(step)
        if not (path / MARKER).is_file():
            raise OSError(f"checkpoint {path} is not complete")
        if (reason := damage(path)) is not None:
            raise OSError(f"checkpoint {path} is damaged ({reason})")
        return path

    def clear_partial(self) -> None:
        for path in self.root.glob("*") if self.root.is_dir() else []:
            if path.is_dir() and not (path / MARKER).is_file():
                shutil.rmtree(path)

    def save(self, state: dict[str, Any], keep: int, write: WriteFn, expected_bytes: int, main: bool,
             barrier: Barrier) -> int:
        final, tmp = self.root / _step_name(state["step"]), self.root / f"tmp-{_step_name(state['step'])}"
        previous = self.complete()
        ensure_free_space(self.root, max(expected_bytes, checkpoint_bytes(previous[-1][1]) if previous else 0),
                          "a checkpoint")
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        files: dict[str, Any] = {}
        try:
            write(tmp)
            barrier()
            if main:
                fault_point(f"checkpoint-files:{state['step']}")
                files = describe_files(tmp, exclude=MARKER)
                (tmp / MARKER).write_text(_marker_text(state, files))
        except OSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _disk_full(error, tmp) from error
        if main:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for _, old in self.complete()[:-keep]:
                shutil.rmtree(old)
            fault_point(f"checkpoint:{state['step']}")
        barrier()
        return sum(record["bytes"] for record in files.values())  # the trainer's files (rank 0 knows them)

    def rewrite_marker(self, path: Path, state: dict[str, Any]) -> None:
        _replace_marker(path, state)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------- on a bucket

def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: running
        return True
    return True


def _gather(value: Any) -> list[Any]:
    """`value` of every process of the run (a sync point), in rank order; [value] alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class BucketPlace:
    """Checkpoints under the URL `url`; `local` (`<work_dir>/checkpoints`) holds this node's
    staging folders and views of downloaded checkpoints."""

    def __init__(self, local: Path, url: str, cache: ObjectCache | None = None):
        import fsspec

        self.local, self.url = Path(local), url.rstrip("/")
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.path = self.path.rstrip("/")
        self.cache = cache or ObjectCache()

    def _url(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def _key(self, *parts: str) -> str:
        return "/".join([self.path, *parts])

    def _steps(self) -> list[int]:
        """Every step with anything under its prefix, complete or not, oldest first."""
        def listing() -> list[str]:
            try:
                return self.fs.ls(self.path, detail=False, refresh=True)
            except FileNotFoundError:
                bucket = self.path.split("/", 1)[0]
                if not self.fs.exists(bucket):
                    raise
                return []

        names = on_bucket(self.url, "listing checkpoints", listing)
        steps = []
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if base.startswith("step-") and base[5:].isdigit():
                steps.append(int(base[5:]))
        return sorted(steps)

    def _marker(self, step: int) -> dict[str, Any] | None:
        url = self._url(_step_name(step), MARKER)
        try:
            text = on_bucket(url, "reading a checkpoint marker",
                             lambda: self.fs.cat_file(self._key(_step_name(step), MARKER)), missing_ok=True)
        except FileNotFoundError:
            return None
        return json.loads(text)

    def complete(self) -> list[tuple[int, Path]]:
        return [(step, self._view(step)) for step in self._steps() if self._marker(step) is not None]

    def _view(self, step: int) -> Path:
        return self.local / f"{_step_name(step)}.view-{os.getpid()}"

    def latest_good(self, main: bool) -> tuple[int, Path] | None:
        for step in reversed(self._steps()):
            marker = self._marker(step)
            if marker is None:
                continue  # files without their marker: never taken as a checkpoint
            try:
                return step, self._fetch(step, marker)
            except (ObjectDamaged, FileNotFoundError) as error:
                log.warning("checkpoint %s is damaged (%s); falling back to the one before it",
                            self._url(_step_name(step)), error)
                if main:
                    self._delete(step)
        return None

    def at(self, step: int) -> Path:
        """Complete checkpoint `step` as a local view; ObjectDamaged when it is not there or damaged."""
        if (marker := self._marker(step)) is None:
            raise ObjectDamaged(f"{self._url(_step_name(step), MARKER)}: no such checkpoint marker")
        return self._fetch(step, marker)

    def _fetch(self, step: int, marker: dict[str, Any]) -> Path:
        """A local view of the checkpoint: its files through the cache, hard-linked, and its marker."""
        for old in self.local.glob("*.view-*"):  # this process's earlier views, and those of dead ones
            pid = old.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or int(pid) == os.getpid() or not _running(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        view = self._view(step)
        for rel, record in marker.get(FILES_KEY, {}).items():
            entry = self.cache.fetch(self._url(_step_name(step), rel), record["bytes"], record["sha256"])
            link_into(entry, view / rel)
        (view / MARKER).write_text(json.dumps(marker) + "\n")
        return view

    def _delete(self, step: int) -> None:
        """Marker first: a checkpoint is never complete with files missing."""
        prefix = _step_name(step)
        for key, recursive in ((self._key(prefix, MARKER), False), (self._key(prefix), True)):
            with contextlib.suppress(FileNotFoundError):
                on_bucket(self._url(prefix), "deleting a checkpoint",
                          lambda key=key, recursive=recursive: self.fs.rm(key, recursive=recursive), missing_ok=True)

    def clear_partial(self) -> None:
        for step in self._steps():
            if self._marker(step) is None:
                self._delete(step)
        shutil.rmtree(self.local, ignore_errors=True)  # staging folders and views of earlier runs

    def save(self, state: dict[str, Any], keep: int, write: WriteFn, expected_bytes: int, main: bool,
             barrier: Barrier) -> int:
        step = state["step"]
        staging = self.local / f"tmp-{_step_name(step)}-{os.getpid()}"
        ensure_free_space(self.local, expected_bytes, "a checkpoint")
        if main:
            self._delete(step)  # what a crashed run left of this step
        barrier()
        try:
            files, failure = self._write_and_upload(step, staging, write), None
        except OSError as error:
            files, failure = {}, error
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        everyone = _gather((files, str(failure) if failure else None))  # every rank's files are up
        if failure is not None:
            raise _disk_full(failure, staging) from failure
        if failed := [why for _, why in everyone if why]:
            raise BucketError(f"{self._url(_step_name(step))}: another rank's upload failed: {failed[0]}")
        merged = {rel: record for share, _ in everyone for rel, record in share.items()}
        if main:
            fault_point(f"checkpoint-files:{step}")
            url = self._url(_step_name(step), MARKER)
            on_bucket(url, "uploading a checkpoint marker",
                      lambda: self.fs.pipe_file(self._key(_step_name(step), MARKER),
                                                _marker_text(state, merged).encode()))
            for old, _ in self.complete()[:-keep]:
                self._delete(old)
            fault_point(f"checkpoint:{step}")
        barrier()
        return sum(record["bytes"] for record in merged.values())

    def _write_and_upload(self, step: int, staging: Path, write: WriteFn) -> dict[str, Any]:
        """This rank's files of checkpoint `step`: written into `staging`, uploaded, adopted by the
        cache (a resume or rollback on this node then downloads nothing); returns their records."""
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        write(staging)
        files = describe_files(staging, exclude=MARKER)
        for rel, record in files.items():
            key = self._key(_step_name(step), rel)
            on_bucket(self._url(_step_name(step), rel), "uploading a checkpoint file",
                      lambda rel=rel, key=key: self.fs.put_file(str(staging / rel), key))
            self.cache.put(staging / rel, record["sha256"])
        return files

    def rewrite_marker(self, path: Path, state: dict[str, Any]) -> None:
        files = _replace_marker(path, state)
        if _rank() == 0:
            step = _step_name(state["step"])
            on_bucket(self._url(step, MARKER), "rewriting a checkpoint marker",
                      lambda: self.fs.pipe_file(self._key(step, MARKER), _marker_text(state, files).encode()))

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            on_bucket(self.url, "deleting checkpoints", lambda: self.fs.rm(self.path, recursive=True),
                      missing_ok=True)
        shutil.rmtree(self.local, ignore_errors=True)
