"""Training checkpoints on a bucket: `BucketPlace`, the place model/checkpoint.py's `checkpoint_place`
gives a work directory that its `StoreMapping` maps onto the artifact store's bucket. The functions
the trainers call, and the layout on the local disk, are model/checkpoint.py's.

With `GRISTMILL_STORE=s3://...` or `gs://...` (so that a training stage's ranks on nodes that share
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
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from gristmill.core import object_store
from gristmill.core.cache import ObjectCache, link_into
from gristmill.core.faults import fault_point
from gristmill.core.files import describe_files, ensure_free_space
from gristmill.core.object_store import ObjectDamaged, ObjectStoreError
from gristmill.model.checkpoint_files import (
    FILES_KEY,
    MARKER,
    Barrier,
    WriteFn,
    disk_full,
    gather,
    log,
    marker_text,
    replace_marker,
    step_name,
)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: running
        return True
    return True



class BucketPlace:
    """Checkpoints under the URL `url`; `local` (`<work_dir>/checkpoints`) holds this node's
    staging folders and views of downloaded checkpoints."""

    def __init__(self, local: Path, url: str, cache: ObjectCache | None = None):
        self.local, self.url = Path(local), url.rstrip("/")
        self.cache = cache or ObjectCache()

    def _url(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def _steps(self) -> list[int]:
        """Every step with anything under its prefix, complete or not, oldest first."""
        names = object_store.names(self.url)
        if not names and not object_store.bucket_exists(self.url):
            raise ObjectStoreError(f"{self.url}: listing checkpoints failed: not found; is the bucket there?")
        return sorted(int(name[5:]) for name in names if name.startswith("step-") and name[5:].isdigit())

    def _marker(self, step: int) -> dict[str, Any] | None:
        text = object_store.read_bytes(self._url(step_name(step), MARKER))
        return None if text is None else json.loads(text)

    def complete(self) -> list[tuple[int, Path]]:
        return [(step, self._view(step)) for step in self._steps() if self._marker(step) is not None]

    def _view(self, step: int) -> Path:
        return self.local / f"{step_name(step)}.view-{os.getpid()}"

    def latest_good(self, main: bool) -> tuple[int, Path] | None:
        for step in reversed(self._steps()):
            marker = self._marker(step)
            if marker is None:
                continue  # files without their marker: never taken as a checkpoint
            try:
                return step, self._fetch(step, marker)
            except (ObjectDamaged, FileNotFoundError) as error:
                log.warning("checkpoint %s is damaged (%s); falling back to the one before it",
                            self._url(step_name(step)), error)
                if main:
                    self._delete(step)
        return None

    def at(self, step: int) -> Path:
        """Complete checkpoint `step` as a local view; ObjectDamaged when it is not there or damaged."""
        if (marker := self._marker(step)) is None:
            raise ObjectDamaged(f"{self._url(step_name(step), MARKER)}: no such checkpoint marker")
        return self._fetch(step, marker)

    def _fetch(self, step: int, marker: dict[str, Any]) -> Path:
        """A local view of the checkpoint: its files through the cache, hard-linked, and its marker."""
        for old in self.local.glob("*.view-*"):  # this process's earlier views, and those of dead ones
            pid = old.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or int(pid) == os.getpid() or not _running(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        view = self._view(step)
        for rel, record in marker.get(FILES_KEY, {}).items():
            entry = self.cache.fetch(self._url(step_name(step), rel), record["bytes"], record["sha256"])
            link_into(entry, view / rel)
        (view / MARKER).write_text(json.dumps(marker) + "\n")
        return view

    def _delete(self, step: int) -> None:
        """Marker first: a checkpoint is never complete with files missing."""
        object_store.remove(self._url(step_name(step), MARKER))
        object_store.remove(self._url(step_name(step)), recursive=True)

    def clear_partial(self) -> None:
        for step in self._steps():
            if self._marker(step) is None:
                self._delete(step)
        shutil.rmtree(self.local, ignore_errors=True)  # staging folders and views of earlier runs

    def save(self, state: dict[str, Any], keep: int, write: WriteFn, expected_bytes: int, main: bool,
             barrier: Barrier) -> int:
        step = state["step"]
        staging = self.local / f"tmp-{step_name(step)}-{os.getpid()}"
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
        everyone = gather((files, str(failure) if failure else None))  # every rank's files are up
        if failure is not None:
            raise disk_full(failure, staging) from failure
        if failed := [why for _, why in everyone if why]:
            raise ObjectStoreError(f"{self._url(step_name(step))}: another rank's upload failed: {failed[0]}")
        merged = {rel: record for share, _ in everyone for rel, record in share.items()}
        if main:
            fault_point(f"checkpoint-files:{step}")
            object_store.put_bytes(self._url(step_name(step), MARKER), marker_text(state, merged).encode())
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
            object_store.put_file(staging / rel, self._url(step_name(step), rel))
            self.cache.put(staging / rel, record["sha256"])
        return files

    def rewrite_marker(self, path: Path, state: dict[str, Any]) -> None:
        """By the main process (as every marker): its local view, then the marker object."""
        files = replace_marker(path, state)
        object_store.put_bytes(self._url(step_name(state["step"]), MARKER), marker_text(state, files).encode())

    def remove(self) -> None:
        object_store.remove(self.url, recursive=True)
        shutil.rmtree(self.local, ignore_errors=True)
