"""Every byte gristmill moves to or from an object store goes through here: a URL to its backend,
atomic puts, gets checked against their sha256, listing, deletion, the conditional writes a lease
is made of, and one retry policy for all of them.

    s3://bucket/prefix    S3Backend    (s3fs; credentials and endpoint from the standard AWS variables)
    gs://bucket/prefix    GCSBackend   (gcsfs, the `gcs` extra; GOOGLE_APPLICATION_CREDENTIALS,
                                        STORAGE_EMULATOR_HOST for an emulator)

A backend is one class: its scheme, the package it needs, how to make its fsspec filesystem, and its
conditional writes (S3 `If-None-Match: *` / `If-Match: <ETag>`, GCS `ifGenerationMatch`). Any other
scheme, or a backend whose package is missing, is an `ObjectStoreError` of one line saying what to
use or install. Other fsspec URLs (memory://, http://...) are not object stores; data sources may
still name them, and `filesystem` opens them alike.

The retry policy (`POLICY`) is the only one: the backends' clients are built with their own retry
loops off, so a call is tried as often as the policy says and no more, and `retries()` counts every
try after a first. Only transient failures are retried (connection refused, reset or closed, a
timeout, HTTP 408, 429 and 5xx, throttling); a refusal (403), absence (404) or anything else is not.
A pause grows exponentially with full jitter, and both the attempts and the seconds are bounded.
What retrying cannot fix is an `ObjectStoreError` of one line naming the URL and, for credentials or
an endpoint that does not answer, the variables the backend reads.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import quote

T = TypeVar("T")


class ObjectStoreError(OSError):
    """An object-store call that cannot succeed, in one line naming the URL (and what to change)."""


class ObjectDamaged(OSError):
    """An object whose bytes are not those its record lists (truncated, changed, missing)."""


# ------------------------------------------------------------------------------- the retry policy

_TRANSIENT_NAMES = ("Connect", "Timeout", "Disconnected", "IncompleteRead", "ChunkedEncoding", "PayloadError",
                    "ResponseStreamingError", "ProtocolError", "ProxyError")
_THROTTLING_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                               "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"})


def error_chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from (clients wrap a connection error in their own)."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _status(error: BaseException) -> int | None:
    """The HTTP status an error carries, in any of the clients' ways of carrying it."""
    for name in ("status", "code", "status_code"):
        value = getattr(error, name, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(error, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    return None


def _throttled(error: BaseException) -> bool:
    response = getattr(error, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") in _THROTTLING_CODES


def unreachable(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain saying the host did not answer (refused, reset, timed out,
    unresolvable), if one does."""
    for cause in error_chain(error):
        name = type(cause).__name__
        if isinstance(cause, (ConnectionError, TimeoutError, socket.gaierror)) or \
                any(n in name for n in _TRANSIENT_NAMES):
            return cause
    return None


def _says_try_again(error: BaseException) -> bool:
    """The error is the caller's marked `transient = True`, throttling, or HTTP 408, 429 or 5xx."""
    status = _status(error)
    return getattr(error, "transient", False) is True or _throttled(error) or \
        (status is not None and (status in (408, 429) or status >= 500))


def transient(error: BaseException) -> bool:
    """Whether trying again may succeed: the host did not answer, or it said so. Never a refusal
    (401/403), an absence (404) or a failed precondition (409/412)."""
    chain = error_chain(error)
    if any(_status(e) in (401, 403, 404, 409, 412) for e in chain):
        return False
    if any(isinstance(e, (PermissionError, FileExistsError)) for e in chain):
        return False
    return unreachable(error) is not None or any(_says_try_again(e) for e in chain)


_retried = [0]
_retried_lock = threading.Lock()


def retries() -> int:
    """Tries after a first made by this process so far (stages report the difference)."""
    return _retried[0]


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries and `budget_s` seconds; the k-th pause is uniform in
    [0, min(max_pause_s, first_pause_s * 2**k)] (full jitter: many clients retrying at once spread out)."""
    attempts: int = 6
    first_pause_s: float = 0.5
    max_pause_s: float = 8.0
    budget_s: float = 60.0

    def pause_s(self, failures: int) -> float:
        return random.uniform(0, min(self.max_pause_s, self.first_pause_s * 2 ** (failures - 1)))

    def call(self, url: str, what: str, call: Callable[[], T], backend: Backend | None = None, *,
             missing_ok: bool = False, keep: tuple[type[BaseException], ...] = (),
             progress: Callable[[], int] | None = None) -> T:
        """`call()`, which does `what` with the object or prefix at `url`, tried again while it fails
        transiently and the policy allows. FileNotFoundError when `missing_ok` and nothing is there
        (the caller knows what absence means); an error of a `keep` type as it is (the caller's own);
        everything else that fails an ObjectStoreError. With `progress` (bytes so far of a transfer
        that resumes where it stopped), a try that moved it on starts the count and the clock again."""
        started, failures, best = time.monotonic(), 0, progress() if progress else 0
        while True:
            try:
                return call()
            except (ObjectStoreError, *keep):
                raise
            except Exception as error:  # clients raise their own types (botocore, aiohttp, google.auth)
                if not transient(error):
                    raise _final(url, what, error, backend, missing_ok) from None
                if progress is not None and (now := progress()) > best:
                    started, failures, best = time.monotonic(), 0, now
                failures += 1
                pause = self.pause_s(failures)
                if failures == self.attempts or time.monotonic() - started + pause > self.budget_s:
                    if unreachable(error) is not None:
                        why = f"{'failed: ' if what else ''}its host did not answer in {failures} tries"
                    else:
                        why = f"failed {failures} times"
                    raise ObjectStoreError(_line(url, what, f"{why} ({_cause(error)}){_endpoint(backend)}")) from None
                with _retried_lock:
                    _retried[0] += 1
                time.sleep(pause)


POLICY = RetryPolicy()


def _line(url: str, what: str, detail: str) -> str:
    """The one line of a failed call: the URL, what was being done (when said), what went wrong."""
    return f"{url}: {what} {detail}" if what else f"{url}: {detail}"


def _cause(error: BaseException) -> str:
    cause = unreachable(error) or error
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else 'no message'}"


def _endpoint(backend: Backend | None) -> str:
    return f"; {backend.endpoint_hint()}" if backend is not None else ""


def backend_if_any(url: str) -> Backend | None:
    """The backend of an object store's URL; None for any other (a local path, http://, ftp://)."""
    return backend_of(url) if is_object_store(url) else None


def _final(url: str, what: str, error: BaseException, backend: Backend | None, missing_ok: bool) -> BaseException:
    """What a call that retrying cannot fix raises: FileNotFoundError for absence when the caller
    asked for it, else one line naming the URL."""
    chain = error_chain(error)
    if any(type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
                                "RefreshError") or isinstance(e, PermissionError) or _status(e) in (401, 403)
           for e in chain):
        hint = backend.credentials_hint() if backend is not None else "check the store's credentials"
        return ObjectStoreError(_line(url, what, f"refused ({_cause(error)}); {hint}"))
    if any(isinstance(e, FileNotFoundError) or _status(e) == 404 for e in chain):
        if missing_ok:
            return FileNotFoundError(url)
        return ObjectStoreError(_line(url, what, "failed: not found; is the bucket there?"))
    return ObjectStoreError(_line(url, what, f"failed: {_cause(error)}"))


# ------------------------------------------------------------------------------------ the backends

class Backend:
    """One kind of object store. Subclasses set the class fields and implement the conditional
    writes; everything else is fsspec's."""
    schemes: ClassVar[tuple[str, ...]]
    package: ClassVar[str]  # the import that makes the backend available
    install: ClassVar[str]  # what to install for it
    # the environment its client reads (credentials, endpoint), by prefix: what a process on another
    # node needs of the driver's (infra/ray_engine.py)
    variables: ClassVar[tuple[str, ...]]

    def __init__(self) -> None:
        self.fs: Any = self.filesystem()

    def filesystem(self) -> Any:
        raise NotImplementedError

    def credentials_hint(self) -> str:
        raise NotImplementedError

    def endpoint_hint(self) -> str:
        raise NotImplementedError

    # Conditional writes (the lease): a token names one version of an object.
    def create(self, path: str, body: bytes, metadata: dict[str, str]) -> str | None:
        """Write `path` only where nothing is: its token, or None when something already is."""
        raise NotImplementedError

    def replace(self, path: str, body: bytes, metadata: dict[str, str], token: str) -> str | None:
        """Write `path` only while its version is `token`: the new token, or None when it is not."""
        raise NotImplementedError

    def head(self, path: str) -> tuple[str, dict[str, str]] | None:
        """(token, metadata) of `path`, or None when there is none."""
        raise NotImplementedError

    def delete_if(self, path: str, token: str) -> bool:
        """Delete `path` only while its version is `token`; whether it was."""
        raise NotImplementedError


class S3Backend(Backend):
    schemes = ("s3", "s3a")
    package = "s3fs"
    install = "pip install s3fs"
    variables = ("AWS_",)

    def filesystem(self) -> Any:
        import s3fs

        # One retry policy: s3fs's own loop and botocore's retries off (POLICY retries every call).
        fs = s3fs.S3FileSystem(config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}})
        fs.retries = 1
        return fs

    def credentials_hint(self) -> str:
        return ("check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for an "
                "S3-compatible store other than AWS")

    def endpoint_hint(self) -> str:
        return f"the endpoint is AWS_ENDPOINT_URL={os.environ.get('AWS_ENDPOINT_URL', '(unset: AWS S3)')}"

    @staticmethod
    def _lost(error: OSError) -> bool:
        """s3fs's error for a failed If-None-Match (FileExistsError) or If-Match (EINVAL, 412)."""
        return isinstance(error, FileExistsError) or any(_status(e) in (409, 412) for e in error_chain(error)) \
            or "PreconditionFailed" in str(error) or error.errno == 22

    def _put(self, path: str, body: bytes, metadata: dict[str, str], **condition: str) -> str | None:
        bucket, _, key = path.partition("/")
        try:
            out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, Metadata=metadata, **condition)
        except OSError as error:
            if self._lost(error):
                return None
            raise
        return out["ETag"]

    def create(self, path: str, body: bytes, metadata: dict[str, str]) -> str | None:
        return self._put(path, body, metadata, IfNoneMatch="*")

    def replace(self, path: str, body: bytes, metadata: dict[str, str], token: str) -> str | None:
        return self._put(path, body, metadata, IfMatch=token)

    def head(self, path: str) -> tuple[str, dict[str, str]] | None:
        bucket, _, key = path.partition("/")
        try:
            out = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return out["ETag"], out.get("Metadata", {})

    def delete_if(self, path: str, token: str) -> bool:
        bucket, _, key = path.partition("/")
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=token)
        except OSError as error:
            if self._lost(error) or isinstance(error, FileNotFoundError):
                return False
            raise
        return True


class GCSBackend(Backend):
    schemes = ("gs", "gcs")
    package = "gcsfs"
    install = "pip install 'gristmill[gcs]' (gcsfs)"
    variables = ("GOOGLE_", "GCSFS_", "STORAGE_EMULATOR_HOST")

    def filesystem(self) -> Any:
        # gcsfs's core class: its package default (unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false)
        # probes each bucket for zonal storage through an API that emulators lack.
        from gcsfs.core import GCSFileSystem
        from gcsfs.retry import retry_request

        logging.getLogger("gcsfs").addFilter(_without_gcsfs_retry_records)

        class OneTry(GCSFileSystem):
            # One retry policy: gcsfs retries every request up to 6 times inside, which no option
            # turns off; its request function is wrapped once more with a single try.
            _request = retry_request(retries=1)(  # pyright: ignore[reportCallIssue]  (decorator's factory form)
                GCSFileSystem._request.__wrapped__)

        token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
        return OneTry(token=token)

    def credentials_hint(self) -> str:
        return ("check GOOGLE_APPLICATION_CREDENTIALS (a service account's key file; or `gcloud auth "
                "application-default login`), and STORAGE_EMULATOR_HOST for an emulator")

    def endpoint_hint(self) -> str:
        host = os.environ.get("STORAGE_EMULATOR_HOST", "(unset: Google Cloud)")
        return f"the endpoint is STORAGE_EMULATOR_HOST={host}"

    def _put(self, path: str, body: bytes, metadata: dict[str, str], generation: str) -> str | None:
        """A multipart upload (metadata and bytes in one request) under ifGenerationMatch."""
        bucket, _, key = path.partition("/")
        head = json.dumps({"name": key, "metadata": metadata})
        data = (f'--==0==\nContent-Type: application/json; charset=UTF-8\n\n{head}\n--==0==\n'
                'Content-Type: application/octet-stream\n\n').encode() + body + b"\n--==0==--"
        try:
            out = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                               uploadType="multipart", ifGenerationMatch=generation, data=data, json_out=True,
                               headers={"Content-Type": 'multipart/related; boundary="==0=="'})
        except FileExistsError:  # 412: the precondition failed
            return None
        return str(out["generation"])

    def create(self, path: str, body: bytes, metadata: dict[str, str]) -> str | None:
        return self._put(path, body, metadata, "0")  # generation 0: no live object

    def replace(self, path: str, body: bytes, metadata: dict[str, str], token: str) -> str | None:
        return self._put(path, body, metadata, token)

    def head(self, path: str) -> tuple[str, dict[str, str]] | None:
        bucket, _, key = path.partition("/")
        try:
            out = self.fs.call("GET", "b/{}/o/{}", bucket, key, json_out=True)
        except FileNotFoundError:
            return None
        return str(out["generation"]), out.get("metadata", {})

    def delete_if(self, path: str, token: str) -> bool:
        bucket, _, key = path.partition("/")
        # ifGenerationMatch is GCS's own precondition; the emulators ignore it on a delete, so the
        # generation is also compared first (the only check there, with a window between the two).
        if (current := self.head(path)) is None or current[0] != token:
            return False
        try:
            self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=token)
        except (FileExistsError, FileNotFoundError):
            return False
        return True


def _without_gcsfs_retry_records(record: logging.LogRecord) -> bool:
    """Drop gcsfs's own retry loop's records (a traceback for each failed request, since its loop
    makes one try): the policy retries, and what it cannot fix is one line of its own."""
    return not record.getMessage().startswith("_request ") or "exception" not in record.getMessage()


BACKENDS: tuple[type[Backend], ...] = (S3Backend, GCSBackend)
CLIENT_VARIABLES = tuple(prefix for backend in BACKENDS for prefix in backend.variables)
_made: dict[type[Backend], Backend] = {}
_made_lock = threading.Lock()


def is_object_store(url: str | Path) -> bool:
    return str(url).partition("://")[0] in {s for b in BACKENDS for s in b.schemes}


def backend_of(url: str) -> Backend:
    """The backend of `url`'s scheme, made once per process (and again after `forget`);
    ObjectStoreError in one line for another scheme or a backend whose package is missing."""
    scheme = url.partition("://")[0] if "://" in url else ""
    kind = next((b for b in BACKENDS if scheme in b.schemes), None)
    if kind is None:
        known = ", ".join(f"{b.schemes[0]}://" for b in BACKENDS)
        raise ObjectStoreError(f"{url}: not an object store gristmill knows (use {known} or a local path)")
    with _made_lock:
        if kind not in _made:
            try:
                _made[kind] = kind()
            except ImportError:
                raise ObjectStoreError(f"{url}: {scheme}:// needs the {kind.package} package: "
                                       f"{kind.install}") from None
        return _made[kind]


def forget() -> None:
    """Make the backends anew at their next use (their clients read the environment once: the
    endpoint and credentials of a test or a process that changed them)."""
    with _made_lock:
        for backend in _made.values():
            type(backend.fs).clear_instance_cache()
        _made.clear()


def path_of(url: str) -> str:
    """`bucket/key` of a URL, the form the backends' filesystems take."""
    return url.partition("://")[2].rstrip("/")


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of any URL or local path: a bucket's backend, or fsspec's
    own for anything else (local, memory://, http://, ftp://)."""
    if is_object_store(url):
        return backend_of(url).fs, path_of(url)
    from fsspec.core import url_to_fs

    return url_to_fs(url)


# --------------------------------------------------------------- calls on objects, under the policy

def _call(url: str, what: str, call: Callable[[Backend], T], *, missing_ok: bool = False) -> T:
    backend = backend_of(url)
    return POLICY.call(url, what, lambda: call(backend), backend, missing_ok=missing_ok)


def put_file(local: Path, url: str) -> None:
    """Upload a local file in one request: the object appears whole or not at all."""
    _call(url, "uploading", lambda b: b.fs.put_file(str(local), path_of(url)))


def put_files(pairs: Iterable[tuple[Path, str]], what: str = "uploading") -> None:
    """Upload several files at once (the client's concurrency); a retry uploads them all again."""
    pairs = list(pairs)
    if pairs:
        _call(pairs[0][1], what, lambda b: b.fs.put([str(p) for p, _ in pairs], [path_of(u) for _, u in pairs]))


def put_bytes(url: str, data: bytes) -> None:
    _call(url, "writing", lambda b: b.fs.pipe_file(path_of(url), data))


def read_bytes(url: str) -> bytes | None:
    """The object's bytes, or None when there is none."""
    try:
        return _call(url, "reading", lambda b: b.fs.cat_file(path_of(url)), missing_ok=True)
    except FileNotFoundError:
        return None


def get_file(url: str, local: Path, size: int | None = None, sha256: str | None = None) -> None:
    """Download the object to `local`; with `size` and `sha256` (its record's), checked: a
    difference is fetched once more, then an ObjectDamaged naming the URL. FileNotFoundError when
    there is no such object."""
    for attempt in (1, 2):
        _call(url, "downloading", lambda b: b.fs.get_file(path_of(url), str(local)), missing_ok=True)
        if size is None and sha256 is None:
            return
        got = Path(local).stat().st_size
        if size is not None and got != size:
            problem = f"has {got} bytes, its record lists {size} (truncated or changed)"
        elif sha256 is not None and _sha256(Path(local)) != sha256:
            problem = "its bytes do not match the sha256 its record lists"
        else:
            return
        if attempt == 2:
            raise ObjectDamaged(f"{url}: {problem}")


def _sha256(path: Path) -> str:
    # core/files.py's file_digest, which this module may not import: files' URL helpers import it
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def get_files(pairs: Iterable[tuple[str, Path]], what: str = "downloading") -> None:
    pairs = list(pairs)
    if pairs:
        _call(pairs[0][0], what, lambda b: b.fs.get([path_of(u) for u, _ in pairs], [str(p) for _, p in pairs]))


def names(url: str) -> list[str]:
    """Names directly under a prefix, listed afresh (no listing cache); empty when absent."""
    def listing(b: Backend) -> list[str]:
        try:
            return b.fs.ls(path_of(url), detail=False, refresh=True)
        except FileNotFoundError:
            return []

    return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in _call(url, "listing", listing)})


def find(url: str) -> list[str]:
    """Every object under a prefix, as paths relative to it."""
    root = path_of(url)
    return sorted(p.removeprefix(root + "/") for p in _call(url, "listing", lambda b: b.fs.find(root)))


def remove(url: str, *, recursive: bool = False) -> None:
    """Delete an object (or everything under a prefix); nothing there is not an error."""
    with contextlib.suppress(FileNotFoundError):
        _call(url, "deleting", lambda b: b.fs.rm(path_of(url), recursive=recursive), missing_ok=True)


def remove_files(urls: list[str]) -> None:
    if urls:
        with contextlib.suppress(FileNotFoundError):
            _call(urls[0], "deleting", lambda b: b.fs.rm([path_of(u) for u in urls]), missing_ok=True)


def bucket_exists(url: str) -> bool:
    bucket = path_of(url).split("/", 1)[0]
    return _call(url, "looking for the bucket", lambda b: b.fs.exists(bucket))


def size(url: str) -> int:
    """The object's size in bytes; FileNotFoundError when there is none."""
    return _call(url, "reading the size of", lambda b: b.fs.size(path_of(url)), missing_ok=True)


def open_object(url: str) -> io.BufferedReader:
    """The object, opened for reading under the retry policy: a read that fails transiently opens
    it again at the same offset (a dropped connection costs a retry, not the file)."""
    return io.BufferedReader(_Reader(url, backend_of(url)), 1 << 20)


class _Reader(io.RawIOBase):
    def __init__(self, url: str, backend: Backend):
        self.url, self.backend, self.position, self.file = url, backend, 0, None
        self.length = size(url)

    def _opened(self) -> Any:
        if self.file is None:
            # the size known: the client asks for it again on every open otherwise
            self.file = self.backend.fs.open(path_of(self.url), "rb", size=self.length)
            self.file.seek(self.position)
        return self.file

    def _drop(self) -> None:
        if self.file is not None:
            with contextlib.suppress(Exception):
                self.file.close()
            self.file = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        if self.file is not None:
            self.file.seek(self.position)
        return self.position

    def readinto(self, buffer: Any) -> int:
        def attempt() -> bytes:
            try:
                return self._opened().read(len(buffer))
            except Exception:
                self._drop()  # opened afresh, at the same offset, by the next try
                raise

        data = POLICY.call(self.url, "reading", attempt, self.backend, missing_ok=True)
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)

    def close(self) -> None:
        self._drop()
        super().close()


def version_of(url: str) -> str:
    """The store's own version key of an object at any URL (from its ETag or generation, size,
    mtime: fsspec's `checksum`): an edit shows without reading the bytes."""
    scheme = url.partition("://")[0]
    if not is_object_store(url):
        fs, path = filesystem(url)
        return f"{scheme}:{fs.checksum(path):x}"
    return f"{scheme}:{_call(url, 'reading the version of', lambda b: b.fs.checksum(path_of(url))):x}"


# --------------------------------------------------------------------------- conditional writes

def create(url: str, body: bytes, metadata: dict[str, str]) -> str | None:
    """Write the object only where none is (the lease): its token, or None when one is."""
    return _call(url, "creating", lambda b: b.create(path_of(url), body, metadata))


def replace(url: str, body: bytes, metadata: dict[str, str], token: str) -> str | None:
    """Write the object only while its version is `token`: the new token, or None."""
    return _call(url, "replacing", lambda b: b.replace(path_of(url), body, metadata, token))


def head(url: str) -> tuple[str, dict[str, str]] | None:
    return _call(url, "reading", lambda b: b.head(path_of(url)))


def delete_if(url: str, token: str) -> bool:
    return _call(url, "deleting", lambda b: b.delete_if(path_of(url), token))
