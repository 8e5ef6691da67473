"""This node's cache of objects downloaded from a bucket: `$GRISTMILL_CACHE/objects`, bounded in
size, least recently used evicted.

    <cache>/objects/<sha256[:2]>/<sha256>    one object's bytes, named by their digest
    <cache>/objects/.incoming-*              a download in progress (renamed into place when verified)
    <cache>/objects/cache.lock               flock held while an object is put in place or evicted
    <cache>/objects/trees/<hash of a path>   a link to a folder made of entries' hard links (an
                                             artifact downloaded into the store's local copy),
                                             which eviction may delete: it can be downloaded again

Entries are content-addressed: whatever URL an object came from, its bytes are named by their
sha256, which the record that listed it (a checkpoint marker, an artifact manifest) gives. So an
entry is never stale, two URLs of the same bytes share one entry, and wiping the cache (or losing
any entry to eviction) costs a download, never a wrong answer. A download (core/object_store.py's,
under its retry policy) is verified, size then sha256, before it is renamed into place; one that
differs is an `ObjectDamaged` naming the URL, and nothing is kept of it. Several processes of one
node share the cache: downloads go to names of their own, the rename into place is atomic, and
eviction runs under the lock. Using an entry refreshes its mtime, the age eviction goes by; the
newest entries stay and the bound is `GRISTMILL_CACHE_MAX_GB` (default 20 GiB, what a small node's
disk spares), checked after each download. The size counts each file once however many links it has,
the folders of `keep_tree` included, and a tree goes whole (renamed aside as `.<name>.download-
evicted-<pid>`, then deleted), so downloaded artifacts and checkpoints together stay within the
bound. An entry evicted while a process still reads it stays readable to that process (POSIX keeps
unlinked files open); callers that keep using a path link it first (`link_into`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from gristmill.core import object_store
from gristmill.core.object_store import ObjectDamaged

CACHE_ENV = "GRISTMILL_CACHE"
MAX_GB_ENV = "GRISTMILL_CACHE_MAX_GB"
DEFAULT_MAX_GB = 20.0
OBJECTS = "objects"
LOCK = "cache.lock"
TREES = "trees"


def cache_root() -> Path:
    """`$GRISTMILL_CACHE`, by default `~/.cache/gristmill` (under `$XDG_CACHE_HOME` when set)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gristmill"
    return Path(os.environ.get(CACHE_ENV) or default)


def max_bytes() -> int:
    """The bound on the objects' total size: `$GRISTMILL_CACHE_MAX_GB` GiB (default 20)."""
    return int(float(os.environ.get(MAX_GB_ENV) or DEFAULT_MAX_GB) * 2**30)


class ObjectCache:
    """Verified local copies of objects, by sha256, under `root/objects`, at most `limit` bytes."""

    def __init__(self, root: Path | None = None, limit: int | None = None):
        self.dir = Path(root if root is not None else cache_root()) / OBJECTS
        self.limit = max_bytes() if limit is None else limit

    def entry(self, sha256: str) -> Path:
        return self.dir / sha256[:2] / sha256

    @contextlib.contextmanager
    def _incoming(self, entry: Path) -> Iterator[Path]:
        """A temporary name in the cache's folder for an object on its way in: renamed to `entry`
        (under the cache's lock) when the block ends without an error, removed in any case."""
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=".incoming-", dir=self.dir)
        os.close(handle)
        incoming = Path(name)
        try:
            yield incoming
            with self._locked():
                os.replace(incoming, entry)
        finally:
            incoming.unlink(missing_ok=True)

    def fetch(self, url: str, size: int, sha256: str, *, evict: bool = True) -> Path:
        """The local copy of the object at `url`, whose record says it has `size` bytes of digest
        `sha256`: the cached entry when there is one, else downloaded, verified and put in place
        (then older entries evicted down to the bound). ObjectDamaged when the bucket's bytes
        differ from the record; ObjectStoreError when the bucket cannot be read."""
        entry = self.entry(sha256)
        if _size(entry) == size:
            _touch(entry)
            return entry
        with self._incoming(entry) as incoming:
            try:
                object_store.get_file(url, incoming, size, sha256)
            except FileNotFoundError:
                raise ObjectDamaged(f"{url}: missing, its record lists {size} bytes") from None
        if evict:
            self.evict(keep=entry)
        return entry

    def put(self, path: Path, sha256: str) -> Path:
        """Adopt a local file of digest `sha256` (one this process just uploaded) as its entry, by a
        hard link when it can (no copy) or else a copy; the file itself stays where it is."""
        entry = self.entry(sha256)
        if entry.exists():
            _touch(entry)
            return entry
        with self._incoming(entry) as incoming:
            incoming.unlink()
            try:
                os.link(path, incoming)
            except OSError:  # another filesystem
                shutil.copyfile(path, incoming)
        self.evict(keep=entry)
        return entry

    def fill(self, directory: Path, objects: Mapping[str, tuple[str, int, str]]) -> None:
        """Put each object (relative path -> (URL, bytes, sha256)) at `directory/<path>`, hard-linked
        from its fetched entry; no eviction: the caller registers the folder (`keep_tree`), which
        evicts with the folder counted, so its objects are not taken while it is being filled."""
        for rel, (url, size, sha256) in objects.items():  # evicted after, once: it scans the whole cache
            link_into(self.fetch(url, size, sha256, evict=False), Path(directory) / rel)

    def _tree_link(self, folder: Path) -> Path:
        return self.dir / TREES / hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:32]

    def keep_tree(self, folder: Path) -> None:
        """Count `folder` (filled by `fill`) in the bound, and let eviction delete it when it is the
        least recently used; `touch_tree` marks it used."""
        link = self._tree_link(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(folder).resolve())
        os.replace(tmp, link)
        self.evict(keep=link)

    def touch_tree(self, folder: Path) -> None:
        link = self._tree_link(folder)
        with contextlib.suppress(FileNotFoundError):
            os.utime(link, follow_symlinks=False)

    def entries(self) -> list[Path]:
        return [p for p in self.dir.glob("??/*") if p.is_file()] if self.dir.is_dir() else []

    def trees(self) -> list[Path]:
        """The links of the folders `keep_tree` registered whose folder is still there."""
        folder = self.dir / TREES
        return [p for p in folder.glob("*") if not p.name.startswith(".") and p.is_dir()] if folder.is_dir() else []

    def size(self) -> int:
        """Bytes on disk of the entries and the registered folders, each file counted once."""
        return _Usage(self.entries(), self.trees()).total

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Delete the least recently used entries and registered folders until the rest fit the
        bound (never `keep`, the one just fetched, even if alone it is larger); returns what went."""
        with self._locked():
            entries, trees = self.entries(), self.trees()
            usage = _Usage(entries, trees)
            units = sorted((p.lstat().st_mtime, p) for p in [*entries, *trees] if p != keep)
            evicted = []
            for _, oldest in units:
                if usage.total <= self.limit:
                    break
                usage.drop(oldest)
                if oldest in trees:
                    _remove_tree(oldest)
                else:
                    oldest.unlink(missing_ok=True)
                evicted.append(oldest)
            for link in (self.dir / TREES).glob("*") if (self.dir / TREES).is_dir() else []:
                if not link.exists():  # its folder was removed by other means
                    link.unlink(missing_ok=True)
            return evicted

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / LOCK).open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield


class _Usage:
    """Bytes on disk of a set of entries and folders, each file (inode) counted once, however many
    of them link it; `drop` takes one out."""

    def __init__(self, entries: list[Path], trees: list[Path]):
        self.links: dict[tuple[int, int], int] = {}
        self.sizes: dict[tuple[int, int], int] = {}
        self.files = {unit: self._files(unit) for unit in [*entries, *trees]}
        for inodes in self.files.values():
            for inode in inodes:
                self.links[inode] = self.links.get(inode, 0) + 1
        self.total = sum(self.sizes.values())

    def _files(self, unit: Path) -> list[tuple[int, int]]:
        found = []
        for path in [unit] if unit.is_file() else unit.rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                info = path.stat()
                if stat.S_ISREG(info.st_mode):
                    self.sizes[(info.st_dev, info.st_ino)] = info.st_size
                    found.append((info.st_dev, info.st_ino))
        return found

    def drop(self, unit: Path) -> None:
        for inode in self.files.pop(unit, []):
            self.links[inode] -= 1
            if self.links[inode] == 0:
                self.total -= self.sizes[inode]


def _remove_tree(link: Path) -> None:
    """Delete a registered folder (renamed aside first, so nobody finds it half deleted) and its link."""
    with contextlib.suppress(FileNotFoundError):
        folder = link.resolve(strict=True)
        aside = folder.with_name(f".{folder.name}.download-evicted-{os.getpid()}")
        os.replace(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)
    link.unlink(missing_ok=True)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _touch(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # evicted meanwhile by another process
        os.utime(path)


def link_into(entry: Path, dest: Path) -> None:
    """Put a cache entry's bytes at `dest` as a hard link (so eviction cannot take them from under
    a reader; no copy) or, across filesystems, as a copy."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.unlink(missing_ok=True)
    try:
        os.link(entry, dest)
    except OSError:
        shutil.copyfile(entry, dest)
