"""Common Crawl collector: choose WARC or WET files of a crawl and download them resumably.

Source syntax (one `sources` entry of the collect stage):

    cc:<crawl id>[?files=<N>][&kind=warc|wet][&seed=<S>]

    crawl id  CC-MAIN-<year>-<ISO week>, e.g. CC-MAIN-2024-22 (the list:
              https://data.commoncrawl.org/crawl-data/index.html); one of another shape, or of a
              year or week no crawl can have, is refused when the source is parsed (at plan time),
              and one the server has no listing for when the listing is fetched (UnknownCrawl)
    files     how many files to take (default 1). A WARC file is ~1 GB, a WET file ~150 MB.
    kind      warc (default: raw HTTP responses, text extracted here by trafilatura) or wet
              (Common Crawl's own extracted plain text)
    seed      without it, the first N files of `crawl-data/<id>/<kind>.paths.gz`, in the
              listing's order (which follows the crawl's segments); with it, a seeded random
              sample of N files (`random.Random(seed).sample`), kept in listing order, so files
              are spread over the segments and the same seed always picks the same files.

e.g. `cc:CC-MAIN-2024-22?files=2&kind=wet&seed=0`.

Downloads (stdlib urllib, any base URL: https://data.commoncrawl.org by default, or a mirror)
retry transient failures (connection errors, timeouts, HTTP 408/429/5xx) with exponential
backoff; the failure count restarts whenever an attempt got further than any before. A download
grows in `<file>.part` and resumes with an HTTP Range request; it is renamed into place only after
verification: size equal to the server's Content-Length and, for .gz, a full gzip read (CRC and
length of every member). A corrupt download is fetched once more from scratch, then a
DownloadError names the URL. A finished file is never fetched again, so a killed run resumes.
"""
from __future__ import annotations

import gzip
import http.client
import logging
import random
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gristmill.core.object_store import ObjectStoreError, RetryPolicy
from gristmill.core.sources import CC_PREFIX, parse_source
from gristmill.core.stage import InputError

DEFAULT_BASE_URL = "https://data.commoncrawl.org"
KINDS = ("warc", "wet")
CRAWL_ID = re.compile(r"CC-MAIN-(\d{4})-(\d{2})")  # CC-MAIN-<year>-<ISO week of the crawl>
FIRST_CRAWL_YEAR = 2013  # the earliest CC-MAIN-<year>-<week> crawl (earlier ones are named otherwise)
RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 60.0
CHUNK_BYTES = 1 << 20
USER_AGENT = "gristmill-collect/0.1"
log = logging.getLogger("gristmill.common_crawl")
T = TypeVar("T")


class DownloadError(RuntimeError):
    """A download that cannot succeed; the message names the URL. `status`: the HTTP status
    that ended it, if one did."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class UnknownCrawl(DownloadError, InputError):
    """The server has no listing of a crawl's files of the kind asked for (HTTP 403/404): a crawl id
    it does not know, or a mirror without it; the message names the crawl and the URL."""


class _Transient(Exception):
    """A failure worth retrying: the connection, a timeout, or a 408/429/5xx answer."""
    transient = True  # what the retry policy retries


class _NothingLeft(Exception):
    """HTTP 416 to a Range request: no bytes after the offset (the .part may be complete)."""

    def __init__(self, total_bytes: int) -> None:
        super().__init__(total_bytes)
        self.total_bytes = total_bytes


@dataclass(frozen=True, kw_only=True)
class CommonCrawlSource:
    """A parsed `cc:` source: which crawl, which listing, how many files and how chosen."""

    crawl_id: str
    files: int = 1
    kind: str = "warc"
    seed: int | None = None

    @classmethod
    def parse(cls, source: str) -> CommonCrawlSource:
        """Parse `cc:<crawl id>[?files=N][&kind=warc|wet][&seed=S]`; errors name the source."""
        parsed = parse_source(source)
        if parsed.kind != "cc":
            raise ValueError(f"source {source!r}: a Common Crawl source starts with {CC_PREFIX!r}")
        crawl_id, _, query = parsed.name.partition("?")
        _check_crawl_id(source, crawl_id)
        try:
            options = dict(urllib.parse.parse_qsl(query, keep_blank_values=True,
                                                  strict_parsing=bool(query)))
        except ValueError as exc:
            raise ValueError(f"source {source!r}: {exc} (expected key=value&...)") from None
        unknown = set(options) - {"files", "kind", "seed"}
        if unknown:
            raise ValueError(f"source {source!r}: unknown option(s) {sorted(unknown)} "
                             "(known: files, kind, seed)")
        kind = options.get("kind", "warc")
        if kind not in KINDS:
            raise ValueError(f"source {source!r}: kind must be one of {KINDS}, got {kind!r}")
        seed = options.get("seed")
        return cls(crawl_id=crawl_id, files=_int_option(source, "files", options.get("files", "1"), 1),
                   kind=kind, seed=None if seed is None else _int_option(source, "seed", seed, 0))

    def paths_url(self, base_url: str = DEFAULT_BASE_URL) -> str:
        """URL of the listing of this crawl's files of this kind."""
        return f"{base_url.rstrip('/')}/crawl-data/{self.crawl_id}/{self.kind}.paths.gz"

    def choose(self, paths: list[str]) -> list[str]:
        """The first `files` paths, or a seeded sample of them in listing order."""
        if self.files > len(paths):
            raise ValueError(f"cc:{self.crawl_id}: files={self.files} but the {self.kind} "
                             f"listing has {len(paths)} files")
        if self.seed is None:
            return paths[:self.files]
        picked = random.Random(self.seed).sample(range(len(paths)), self.files)
        return [paths[i] for i in sorted(picked)]


def _check_crawl_id(source: str, crawl_id: str) -> None:
    """ValueError naming the source unless `crawl_id` could be a crawl: CC-MAIN-<year>-<week>, a
    year from FIRST_CRAWL_YEAR to this one and an ISO week (01-53). Whether the crawl exists is the
    server's to say, when its listing is fetched."""
    match = CRAWL_ID.fullmatch(crawl_id)
    year, week = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not (FIRST_CRAWL_YEAR <= year <= time.gmtime().tm_year and 1 <= week <= 53):
        raise ValueError(f"source {source!r}: crawl id {crawl_id!r} cannot be a Common Crawl crawl: "
                         f"CC-MAIN-<year>-<week>, a year from {FIRST_CRAWL_YEAR} to this one and a "
                         "week 01-53, e.g. CC-MAIN-2024-22 (https://data.commoncrawl.org/crawl-data/index.html)")


def _int_option(source: str, key: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ValueError(f"source {source!r}: {key} must be an integer >= {minimum}, "
                         f"got {value!r}")
    return number


def _retrying(url: str, attempt: Callable[[], T], retries: int, backoff_s: float,
              progress: Callable[[], int] = lambda: 0, timeout_s: float = 60.0) -> T:
    """attempt() under the one retry policy (core/object_store.py) until it stops raising
    _Transient: at most `retries` retries in a row without new progress (bytes beyond the best
    seen), pausing up to backoff_s * 2**k between them."""
    policy = RetryPolicy(attempts=retries + 1, first_pause_s=backoff_s, max_pause_s=MAX_BACKOFF_S,
                         budget_s=(retries + 1) * (timeout_s + MAX_BACKOFF_S))
    last: list[_Transient] = []

    def remembered() -> T:
        try:
            return attempt()
        except _Transient as exc:
            last[:] = [exc]
            raise

    try:
        return policy.call(url, "downloading", remembered, keep=(DownloadError, _NothingLeft), progress=progress)
    except ObjectStoreError:
        raise DownloadError(f"{url}: giving up after {retries} retries: {last[0]}") from None


def _open(url: str, timeout_s: float, offset: int = 0) -> http.client.HTTPResponse:
    """A response for `url` (from byte `offset`); _Transient or DownloadError on failure."""
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                      timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code in RETRY_STATUS:
            raise _Transient(f"HTTP {exc.code} {exc.reason}") from None
        if exc.code == 416 and offset:
            total = re.fullmatch(r"bytes \*/(\d+)", exc.headers.get("Content-Range", ""))
            raise _NothingLeft(int(total.group(1)) if total else -1) from None
        raise DownloadError(f"{url}: HTTP {exc.code} {exc.reason}", exc.code) from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, OSError):  # refused, reset, DNS, timeout
            raise _Transient(str(exc.reason)) from None
        raise DownloadError(f"{url}: {exc.reason}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise _Transient(repr(exc)) from None


def get_bytes(url: str, *, retries: int = 5, timeout_s: float = 60.0,
              backoff_s: float = 1.0) -> bytes:
    """A small file, whole, into memory (with retries)."""
    def attempt() -> bytes:
        with _open(url, timeout_s) as response:
            try:
                return response.read()
            except (OSError, http.client.HTTPException) as exc:  # incl. IncompleteRead
                raise _Transient(repr(exc)) from None

    return _retrying(url, attempt, retries, backoff_s, timeout_s=timeout_s)


def list_files(src: CommonCrawlSource, base_url: str = DEFAULT_BASE_URL, *, retries: int = 5,
               timeout_s: float = 60.0, backoff_s: float = 1.0) -> list[str]:
    """URLs of the chosen files of a crawl (see CommonCrawlSource.choose); UnknownCrawl when the
    server has no listing of it."""
    url = src.paths_url(base_url)
    try:
        data = get_bytes(url, retries=retries, timeout_s=timeout_s, backoff_s=backoff_s)
    except DownloadError as exc:
        if exc.status not in (403, 404):  # S3 behind a CDN answers 403 for a missing key
            raise
        raise UnknownCrawl(f"{exc}: no {src.kind} listing for crawl {src.crawl_id!r}; is the "
                           "crawl id right?", exc.status) from None
    try:
        lines = gzip.decompress(data).decode("utf-8").split()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise DownloadError(f"{url}: not a gzipped list of paths ({exc})") from None
    return [f"{base_url.rstrip('/')}/{path}" for path in src.choose(lines)]


def local_path(url: str, dest_dir: Path) -> Path:
    """Where a file's download lives: dest_dir/<the URL's path> (crawl-data/<id>/segments/...)."""
    relative = urllib.parse.urlsplit(url).path.lstrip("/")
    if not relative or ".." in relative.split("/"):
        raise ValueError(f"{url}: no usable file path in this URL")
    return Path(dest_dir) / relative


def _content_range(response: http.client.HTTPResponse) -> tuple[int, int]:
    """(first byte, total size or -1) of a 206 answer's `Content-Range: bytes a-b/total`."""
    match = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("Content-Range", ""))
    if match is None:
        raise _Transient(f"bad Content-Range {response.headers.get('Content-Range')!r}")
    total = match.group(2)
    return int(match.group(1)), -1 if total == "*" else int(total)


def _fetch_into(url: str, part: Path, timeout_s: float) -> int:
    """One attempt: the rest of `url` appended to `part`; returns the file's total size in
    bytes as the server states it (-1: not stated)."""
    offset = part.stat().st_size if part.exists() else 0
    try:
        response = _open(url, timeout_s, offset)
    except _NothingLeft as exc:  # verification decides whether the part is the whole file
        return exc.total_bytes
    with response:
        length = int(response.headers.get("Content-Length") or -1)
        if response.status == 206:
            start, total = _content_range(response)
        else:  # 200: the server sent the whole file (it may ignore Range)
            start, total = 0, length
        if start not in (0, offset):
            raise _Transient(f"asked for bytes from {offset}, got from {start}")
        received = _copy(response, part, append=start > 0)
    if 0 <= length != received:
        raise _Transient(f"connection closed after {received} of {length} bytes")
    return total


def _copy(response: http.client.HTTPResponse, part: Path, append: bool) -> int:
    """Body → part, in 1 MiB chunks; bytes written (kept on disk when the connection drops)."""
    received = 0
    with open(part, "ab" if append else "wb") as f:
        try:
            while chunk := response.read(CHUNK_BYTES):
                f.write(chunk)
                received += len(chunk)
        except (OSError, http.client.HTTPException) as exc:  # incl. IncompleteRead, timeouts
            f.flush()
            raise _Transient(f"connection lost after {received} bytes: {exc!r}") from None
    return received


def verify(path: Path, expected_bytes: int = -1, gzipped: bool | None = None) -> str | None:
    """Why a downloaded file is not intact, or None: its size vs. the server's, and a full gzip
    read when gzipped (default: when its name ends with .gz)."""
    size = path.stat().st_size
    if expected_bytes >= 0 and size != expected_bytes:
        return f"{size} bytes on disk, server said {expected_bytes}"
    if path.name.endswith(".gz") if gzipped is None else gzipped:
        try:
            with gzip.open(path, "rb") as f:
                while f.read(CHUNK_BYTES):
                    pass
        except (OSError, EOFError, zlib.error) as exc:
            return f"gzip integrity check failed: {exc}"
    return None


def download(url: str, dest: Path, *, retries: int = 5, timeout_s: float = 60.0,
             backoff_s: float = 1.0) -> Path:
    """`url` → `dest`, resuming `dest`.part; verified (see verify), re-fetched once if corrupt."""
    dest = Path(dest)
    if dest.is_file():  # only verified downloads are renamed into place
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")

    def part_bytes() -> int:
        return part.stat().st_size if part.exists() else 0

    problem = None
    for _ in range(2):  # a corrupt download is fetched once more, from scratch
        total = _retrying(url, lambda: _fetch_into(url, part, timeout_s), retries, backoff_s,
                          part_bytes, timeout_s)
        problem = verify(part, total, gzipped=dest.name.endswith(".gz"))
        if problem is None:
            part.replace(dest)
            return dest
        log.warning("%s: corrupt download (%s); fetching it again", url, problem)
        part.unlink()
    raise DownloadError(f"{url}: corrupt download, twice: {problem}")


def fetch(src: CommonCrawlSource, dest_dir: Path, base_url: str = DEFAULT_BASE_URL, *,
          retries: int = 5, timeout_s: float = 60.0, backoff_s: float = 1.0) -> list[Path]:
    """Download the chosen files of a crawl under dest_dir; local paths in listing order."""
    options = {"retries": retries, "timeout_s": timeout_s, "backoff_s": backoff_s}
    return [download(url, local_path(url, dest_dir), **options)
            for url in list_files(src, base_url, **options)]
