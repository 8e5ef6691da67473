"""Committed outputs on an object store: `GRISTMILL_STORE=s3://bucket/prefix` or `gs://bucket/prefix`
(docs/cluster.md); every byte goes through core/object_store.py.

Machines share what the pipeline computed through the bucket instead of a shared filesystem. Each
keeps a local copy of the store under $GRISTMILL_HOME/artifacts (infra/artifacts.py): a stage
computes into its local partial directory (so a killed run resumes on that machine), commits by
uploading, and an output another machine committed is downloaded the first time a run needs it.

    <url>/<stage>/<stage>-<key>/<files>          uploaded first
    <url>/<stage>/<stage>-<key>/manifest.json    uploaded last: the output exists once this does
    <url>/<stage>/<stage>-<key>.lease            which run computes the key now

An object store has no rename and no flock. The lease is created only where none exists (the
backend's own precondition: S3 If-None-Match: *, GCS ifGenerationMatch=0), so of two runs one
computes and the other waits for the manifest. Its holder renews it every third of `lease_s`,
replacing only its own (the token it wrote: S3's ETag, GCS's generation), and deletes it when done.
A lease whose holder is gone (not renewed in time, or a process of this host that no longer runs:
kill -9) is taken over on that lease's token, so of several waiting runs exactly one does. Expiry
compares the holder's clock with the reader's: hosts keep time with NTP, and `lease_s` is far larger
than their drift.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from gristmill.core import object_store
from gristmill.infra.integrity import MANIFEST
from gristmill.infra.processes import recorded

log = logging.getLogger("gristmill.store")

LEASE_S = 60.0  # how long a lease outlives its holder's last renewal
POLL_S = 1.0  # how often a waiting run looks at the manifest and the lease


class StoreURLError(ValueError):
    """A bucket's manifest that would write outside its artifact."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its object's metadata records it."""
    host: str
    pid: int
    started: float  # the holder process's create time: a reused pid is not the holder
    expires: float  # wall-clock seconds
    # One claim's own mark: a write that reached the bucket but whose answer was lost, retried and
    # refused, finds its own lease (not another run's) by it; threads of one process claim apart.
    claim: str = ""

    @classmethod
    def me(cls, lease_s: float, claim: str = "") -> Holder:
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), time.time() + lease_s, claim)

    def gone(self) -> bool:
        """Not renewed in time, or a process of this host that no longer runs."""
        if time.time() > self.expires:
            return True
        return self.host == socket.gethostname() and recorded(self.pid, self.started) is None

    def metadata(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Holder:
        return cls(meta["host"], int(meta["pid"]), float(meta["started"]), float(meta["expires"]),
                   meta.get("claim", ""))


class RemoteStore:
    """Outputs under an object store's URL (core/object_store.py says which stores and how)."""

    def __init__(self, url: str, lease_s: float = LEASE_S):
        if not object_store.is_object_store(url):
            object_store.backend_of(url)  # one line: the schemes there are, or the package to install
        self.url, self.lease_s = url.rstrip("/"), lease_s

    def url_of(self, stage: str, key: str, rel: str = "") -> str:
        base = f"{self.url}/{stage}/{stage}-{key}"
        return f"{base}/{rel}" if rel else base

    def manifest(self, stage: str, key: str) -> dict[str, Any] | None:
        """The committed manifest of (stage, key), or None (read, not listed: listings are cached)."""
        text = object_store.read_bytes(self.url_of(stage, key, MANIFEST))
        return None if text is None else json.loads(text)

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
        object_store.get_files([(self.url_of(stage, key, rel), into / rel) for rel in files])
        object_store.get_file(self.url_of(stage, key, MANIFEST), into / MANIFEST)

    def upload(self, stage: str, key: str, directory: Path, files: list[str]) -> None:
        """The listed files of `directory`, then its manifest: until that exists the output does not."""
        object_store.put_files([(directory / rel, self.url_of(stage, key, rel)) for rel in files])
        object_store.put_file(directory / MANIFEST, self.url_of(stage, key, MANIFEST))
        log.info("%s-%s: committed to %s", stage, key, self.url_of(stage, key))

    # --- the lease ---

    def lease_url(self, stage: str, key: str) -> str:
        return f"{self.url_of(stage, key)}.lease"

    def _put_lease(self, stage: str, key: str, claim: str, token: str | None) -> str | None:
        """Write this claim's lease where none is (`token` None) or over the version `token`;
        its new token, or None when another run's write came first."""
        holder = Holder.me(self.lease_s, claim)
        body, url = json.dumps(asdict(holder)).encode(), self.lease_url(stage, key)
        if token is None:
            written = object_store.create(url, body, holder.metadata())
        else:
            written = object_store.replace(url, body, holder.metadata(), token)
        if written is None and (lease := object_store.head(url)) is not None \
                and Holder.from_metadata(lease[1]).claim == claim:
            return lease[0]  # the write landed and its answer was lost; the retry found it there
        return written

    def _acquire(self, stage: str, key: str, claim: str, committed: Callable[[], bool]) -> str | None:
        """The token of the lease this claim now holds, or None once the key is committed."""
        waiting = False
        while not committed():
            if (token := self._put_lease(stage, key, claim, None)) is not None:
                return token
            if (lease := object_store.head(self.lease_url(stage, key))) is None:
                continue  # released meanwhile
            token, meta = lease
            holder = Holder.from_metadata(meta)
            if holder.gone():
                if (token := self._put_lease(stage, key, claim, token)) is None:
                    continue  # another waiting run took it over first
                log.info("%s-%s: took over the lease of %s pid %d, which is gone", stage, key,
                         holder.host, holder.pid)
                return token
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
        claim = uuid.uuid4().hex
        token = self._acquire(stage, key, claim, committed)
        if token is None:
            yield
            return
        held = {"token": token}
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.lease_s / 3):
                try:
                    renewed = self._put_lease(stage, key, claim, held["token"])
                except OSError as exc:  # the bucket gone for longer than the retry policy allows
                    log.warning("%s-%s: could not renew the lease (%s)", stage, key, exc)
                    return
                if renewed is None:  # taken over: this run's work is no longer the key's
                    log.warning("%s-%s: the lease was taken over by another run", stage, key)
                    return
                held["token"] = renewed

        renewer = threading.Thread(target=renew, name=f"lease-{stage}-{key}", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            try:
                if not object_store.delete_if(self.lease_url(stage, key), held["token"]):
                    log.warning("%s-%s: the lease was not this run's to delete", stage, key)
            except OSError as exc:
                log.warning("%s-%s: could not delete the lease (%s)", stage, key, exc)
