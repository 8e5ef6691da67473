"""Committed outputs on an object store: `GRISTMILL_STORE=s3://bucket/prefix` (docs/cluster.md).

Machines share what the pipeline computed through the bucket instead of a shared filesystem. Each
keeps a local copy of the store under $GRISTMILL_HOME/artifacts (infra/artifacts.py): a stage
computes into its local partial directory (so a killed run resumes on that machine), commits by
uploading, and an output another machine committed is downloaded the first time a run needs it.

    <url>/<stage>/<stage>-<key>/<files>          uploaded first
    <url>/<stage>/<stage>-<key>/manifest.json    uploaded last: the output exists once this does
    <url>/<stage>/<stage>-<key>.lease            which run computes the key now

An object store has no rename and no flock. The lease is created only where none exists
(If-None-Match: *), so of two runs one computes and the other waits for the manifest. Its holder
renews it every third of `lease_s`, replacing only its own (If-Match on the ETag it wrote), and
deletes it when done. A lease whose holder is gone (not renewed in time, or a process of this host
that no longer runs: kill -9) is taken over with If-Match on that lease's ETag, so of several
waiting runs exactly one does. Expiry compares the holder's clock with the reader's: hosts keep
time with NTP, and `lease_s` is far larger than their drift.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from gristmill.infra.processes import recorded

log = logging.getLogger("gristmill.store")

MANIFEST = "manifest.json"  # infra/artifacts.py's name for it: written (here uploaded) last
LEASE_S = 60.0  # how long a lease outlives its holder's last renewal
POLL_S = 1.0  # how often a waiting run looks at the manifest and the lease


class StoreURLError(ValueError):
    """GRISTMILL_STORE names a store this module cannot hold leases on."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its object's metadata records it."""
    host: str
    pid: int
    started: float  # the holder process's create time: a reused pid is not the holder
    expires: float  # wall-clock seconds

    @classmethod
    def me(cls, lease_s: float) -> Holder:
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), time.time() + lease_s)

    def gone(self) -> bool:
        """Not renewed in time, or a process of this host that no longer runs."""
        if time.time() > self.expires:
            return True
        return self.host == socket.gethostname() and recorded(self.pid, self.started) is None

    def metadata(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Holder:
        return cls(meta["host"], int(meta["pid"]), float(meta["started"]), float(meta["expires"]))


def _lost_race(exc: OSError) -> bool:
    """s3fs's error for a failed If-None-Match (FileExistsError) or If-Match (EINVAL)."""
    return isinstance(exc, FileExistsError) or exc.errno == errno.EINVAL


class RemoteStore:
    """Outputs under an s3:// URL, read and written with s3fs (credentials and the endpoint from the
    standard AWS variables)."""

    def __init__(self, url: str, lease_s: float = LEASE_S):
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        if not hasattr(fs, "call_s3"):  # leases need S3's conditional writes
            raise StoreURLError(f"GRISTMILL_STORE={url}: use an s3:// URL or a local path")
        self.url, self.fs, self.root, self.lease_s = url.rstrip("/"), fs, path.rstrip("/"), lease_s

    def _path(self, stage: str, key: str, rel: str = "") -> str:
        base = f"{self.root}/{stage}/{stage}-{key}"
        return f"{base}/{rel}" if rel else base

    def url_of(self, stage: str, key: str) -> str:
        return f"{self.url}/{stage}/{stage}-{key}"

    def manifest(self, stage: str, key: str) -> dict[str, Any] | None:
        """The committed manifest of (stage, key), or None (no listing: s3fs caches those)."""
        try:
            return json.loads(self.fs.cat_file(self._path(stage, key, MANIFEST)))
        except FileNotFoundError:
            return None

    def download(self, stage: str, key: str, files: list[str], into: Path) -> None:
        """The listed files, then the manifest, into the directory `into`. A manifest is read from
        the bucket before anything checks it: a listed path that leaves `into` (absolute, or
        through `..`) is refused before any byte is written."""
        root = into.resolve()
        for rel in files:
            if Path(rel).is_absolute() or not (root / rel).resolve().is_relative_to(root):
                raise StoreURLError(f"{self.url_of(stage, key)}: its manifest lists {rel!r}, a path outside the "
                                    "artifact; the bucket's copy is not used (check who can write to the bucket)")
        for rel in files:
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
        self.fs.get([self._path(stage, key, rel) for rel in files], [str(into / rel) for rel in files])
        self.fs.get_file(self._path(stage, key, MANIFEST), str(into / MANIFEST))

    def upload(self, stage: str, key: str, directory: Path, files: list[str]) -> None:
        """The listed files of `directory`, then its manifest: until that exists the output does not."""
        self.fs.put([str(directory / rel) for rel in files], [self._path(stage, key, rel) for rel in files])
        self.fs.put_file(str(directory / MANIFEST), self._path(stage, key, MANIFEST))
        log.info("%s-%s: committed to %s", stage, key, self.url_of(stage, key))

    # --- the lease ---

    def _lease_key(self, stage: str, key: str) -> tuple[str, str]:
        bucket, _, name = f"{self._path(stage, key)}.lease".partition("/")
        return bucket, name

    def _put_lease(self, stage: str, key: str, **condition: str) -> str:
        """Write this process's lease under `condition` (IfNoneMatch / IfMatch); returns its ETag."""
        bucket, name = self._lease_key(stage, key)
        holder = Holder.me(self.lease_s)
        out = self.fs.call_s3("put_object", Bucket=bucket, Key=name, Metadata=holder.metadata(),
                              Body=json.dumps(asdict(holder)).encode(), **condition)
        return out["ETag"]

    def _read_lease(self, stage: str, key: str) -> tuple[str, Holder] | None:
        """(ETag, holder) of the lease, or None when there is none."""
        bucket, name = self._lease_key(stage, key)
        try:
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=name)
        except FileNotFoundError:
            return None
        return head["ETag"], Holder.from_metadata(head["Metadata"])

    def _acquire(self, stage: str, key: str, committed: Callable[[], bool]) -> str | None:
        """The ETag of the lease this process now holds, or None once the key is committed."""
        waiting = False
        while not committed():
            try:
                return self._put_lease(stage, key, IfNoneMatch="*")
            except OSError as exc:
                if not _lost_race(exc):
                    raise
            if (lease := self._read_lease(stage, key)) is None:
                continue  # released meanwhile
            etag, holder = lease
            if holder.gone():
                try:
                    etag = self._put_lease(stage, key, IfMatch=etag)
                except OSError as exc:
                    if not _lost_race(exc):
                        raise
                    continue  # another waiting run took it over first
                log.info("%s-%s: took over the lease of %s pid %d, which is gone", stage, key,
                         holder.host, holder.pid)
                return etag
            if not waiting:
                log.info("%s-%s is being computed by %s pid %d; waiting for it", stage, key,
                         holder.host, holder.pid)
                waiting = True
            time.sleep(POLL_S)
        return None

    @contextmanager
    def lease(self, stage: str, key: str, committed: Callable[[], bool]) -> Iterator[None]:
        """Hold the key's lease while the body runs, renewed in a thread; returns without it as soon
        as `committed()` (another run finished the key while this one waited)."""
        etag = self._acquire(stage, key, committed)
        if etag is None:
            yield
            return
        held = {"etag": etag}
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.lease_s / 3):
                try:
                    held["etag"] = self._put_lease(stage, key, IfMatch=held["etag"])
                except OSError as exc:  # taken over: this run's work is no longer the key's
                    log.warning("%s-%s: could not renew the lease (%s)", stage, key, exc)
                    return

        renewer = threading.Thread(target=renew, name=f"lease-{stage}-{key}", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            bucket, name = self._lease_key(stage, key)
            try:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=held["etag"])
            except OSError as exc:
                log.warning("%s-%s: the lease was not this run's to delete (%s)", stage, key, exc)
