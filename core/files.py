"""Small file helpers shared by the stages: content digests, JSON-lines reading (local paths and
any fsspec URL), the free-space check made before large writes, a lock file, and a stage folder
that is a local path or a bucket's URL (whose bytes go through core/object_store.py)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def locked(directory: Path, name: str) -> Iterator[None]:
    """An exclusive flock on `directory/name` for the duration of the block: one process at a
    time (e.g. starts or stops the services of one home). The OS releases it if the holder dies."""
    with (Path(directory) / name).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def file_digest(path: Path) -> str:
    """sha256 of a file's content, read in chunks into one buffer (no copy per chunk)."""
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def describe_files(directory: Path, exclude: str) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under `directory` (relative posix paths) except the ones
    named `exclude` (the record being written about them: a manifest, a checkpoint marker)."""
    return {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
            for p in sorted(Path(directory).rglob("*")) if p.is_file() and p.name != exclude}


class JsonLinesError(ValueError):
    """A line of a JSON-lines file that is not JSON (or not an object where one is required); the
    message starts with `file:line`."""


def iter_jsonl(paths: Iterable[Path | str], *, objects_only: bool = False) -> Iterator[Any]:
    """Yield records from JSON-lines files (gzip/zstd by suffix), local or fsspec URLs; blank lines
    are skipped. A line that is not JSON raises JsonLinesError naming the file and line, and so does
    one that is not a JSON object when `objects_only` (else the caller decides what such a record
    is: a reader that counts it as a drop reason)."""
    from fsspec.utils import infer_compression

    for path in paths:
        with _open_text(str(path), infer_compression(str(path))) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise JsonLinesError(f"{path}:{number}: not JSON ({error.msg})") from None
                if objects_only and not isinstance(record, dict):
                    raise JsonLinesError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
                yield record


SPACE_MARGIN = 1.2  # free space asked for, over the expected size of a write


class DiskSpaceError(OSError):
    """Not enough free disk space for a write; the message names the place, the need and what is free."""


def ensure_free_space(directory: Path, needed_bytes: int, what: str) -> None:
    """DiskSpaceError naming `directory` when its filesystem has less than `needed_bytes` (times a
    margin) free; `what` says what was about to be written ("a checkpoint", "a token shard")."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    free, needed = shutil.disk_usage(directory).free, int(needed_bytes * SPACE_MARGIN)
    if free < needed:
        raise DiskSpaceError(errno.ENOSPC, f"not enough free disk space for {what} in {directory}: needs about "
                                           f"{needed / 1e6:,.1f} MB, {free / 1e6:,.1f} MB free; free some space and "
                                           "run again (finished work is kept and the run resumes)")


# --- a stage folder that is a local path or an fsspec URL (an object store every worker can reach) ---

def is_url(location: str | Path) -> bool:
    return "://" in str(location)


def staging_path(dest: str, suffix: str) -> Path:
    """Where a file bound for `dest` is written before `publish_file` puts it there: beside it on
    a local disk, in this machine's temp folder for a URL; its name ends with `suffix`."""
    return Path(tempfile.mkstemp(suffix=suffix)[1]) if is_url(dest) else Path(f"{dest}{suffix}")


def publish_file(finished: Path, dest: str, *, keep: bool = False) -> None:
    """Put the finished local file at `dest` whole: renamed on a local disk, uploaded in one request
    to a URL (an object appears only once complete; object stores have no rename). `keep`: leave
    the local file where it is (a copy goes to `dest`)."""
    if not is_url(dest):
        if keep:
            shutil.copyfile(finished, f"{dest}.tmp")
            finished = Path(f"{dest}.tmp")
        Path(finished).replace(dest)
        return
    from gristmill.core import object_store

    object_store.put_file(finished, dest)
    if not keep:
        Path(finished).unlink()


def fetch_file(location: str, dest: Path) -> None:
    """Move the file at a local path to `dest`, or download the one at a URL there."""
    if not is_url(location):
        Path(location).replace(dest)
        return
    from gristmill.core import object_store

    object_store.get_file(location, dest)


def open_location(location: str | Path, mode: str = "rb") -> Any:
    """A file at a local path or URL, opened (a context manager)."""
    if not is_url(location):
        return Path(location).open(mode)
    from gristmill.core import object_store

    if object_store.is_object_store(location) and mode == "rb":
        return object_store.open_object(str(location))
    fs, path = object_store.filesystem(str(location))
    return fs.open(path, mode)


def _open_text(location: str, compression: str | None) -> Any:
    """A text file (UTF-8, decompressed by `compression`) at a local path or URL."""
    import io

    from fsspec.compression import compr

    raw = open_location(location, "rb")
    if compression is not None:
        raw = compr[compression](raw, mode="rb")  # pyright: ignore[reportArgumentType]  (untyped dict)
    return io.TextIOWrapper(raw, encoding="utf-8")


def names_in(location: str, *, create: bool = False) -> set[str]:
    """The file names directly in a folder or under a URL prefix, listed afresh; empty when absent.
    `create`: make a local folder that is missing (a work folder a killed run resumes from; a URL
    prefix needs no making)."""
    if not is_url(location):
        if create:
            Path(location).mkdir(parents=True, exist_ok=True)
        return {p.name for p in Path(location).iterdir()} if Path(location).is_dir() else set()
    from gristmill.core import object_store

    return set(object_store.names(location))


def remove_tree(location: str) -> None:
    """Delete a folder or everything under a URL prefix; nothing there is not an error."""
    if not is_url(location):
        shutil.rmtree(location, ignore_errors=True)
        return
    from gristmill.core import object_store

    object_store.remove(location, recursive=True)
