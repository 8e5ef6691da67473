"""Common Crawl collector against a local HTTP server: listing, choice of files, downloads that
resume with Range, retries, verification, and clear errors."""
from __future__ import annotations

import gzip
import shutil
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import tasks.collect.read.common_crawl as cc
from tasks.collect.read.common_crawl import CommonCrawlSource, DownloadError
from tasks.collect.read.readers import RawDoc, read_file

CRAWL = "CC-MAIN-TEST"
FAST = {"retries": 3, "timeout_s": 5.0, "backoff_s": 0.01}  # tests must not sleep for seconds
# (name in the crawl, file in shared data) in listing order
WARC_FILES = [
    ("whirlwind.warc.gz", "commoncrawl_whirlwind/whirlwind.warc.gz"),
    ("sample-0000.warc.gz", "dolma_wget/sample-0000.warc.gz"),
    ("example.warc.gz", "warcio_examples/example.warc.gz"),
    ("sample-0001.warc.gz", "dolma_wget/sample-0001.warc.gz"),
]
WET_FILES = [("whirlwind.warc.wet.gz", "commoncrawl_whirlwind/whirlwind.warc.wet.gz")]


class Handler(BaseHTTPRequestHandler):
    """Static files under `root` with Range support, plus faults set per path in `faults`:
    {"503": n} answers 503 n times; {"drop": n} sends half the body then closes, n times;
    {"corrupt": n} serves a copy with flipped bytes n times (0 or absent: behave)."""

    root: Path
    faults: dict[str, Counter]
    requests: list[tuple[str, str | None]]  # (path, Range header)
    ignore_range = False

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _fault(self, kind: str) -> bool:
        counter = self.faults.get(self.path)
        if counter and counter[kind] > 0:
            counter[kind] -= 1
            return True
        return False

    def do_GET(self) -> None:
        self.requests.append((self.path, self.headers.get("Range")))
        file = self.root / self.path.lstrip("/")
        if self._fault("503"):
            return self.send_error(503, "Slow Down")
        if not file.is_file():
            return self.send_error(404, "Not Found")
        data = file.read_bytes()
        if self._fault("corrupt"):
            middle = len(data) // 2
            data = data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + \
                data[middle + 64:]
        start = 0
        ranged = self.headers.get("Range")
        if ranged and not self.ignore_range:
            start = int(ranged.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self._fault("drop"):
            body = body[: len(body) // 2]  # then the connection closes (HTTP/1.0)
        self.wfile.write(body)


def _write_listing(root: Path, kind: str, files: list[tuple[str, str]], shared: Path) -> None:
    lines = []
    for name, source in files:
        rel = f"crawl-data/{CRAWL}/segments/1716000000000.0/{kind}/{name}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shared / "warc" / source, root / rel)
        lines.append(rel)
    listing = root / "crawl-data" / CRAWL / f"{kind}.paths.gz"
    listing.write_bytes(gzip.compress("\n".join(lines).encode() + b"\n"))


@pytest.fixture
def server(tmp_path, shared_data):
    """A crawl layout under tmp_path/site, served on 127.0.0.1; yields the handler class."""
    root = tmp_path / "site"
    _write_listing(root, "warc", WARC_FILES, shared_data)
    _write_listing(root, "wet", WET_FILES, shared_data)
    handler = type("TestHandler", (Handler,), {"root": root, "faults": {}, "requests": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    handler.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield handler
    httpd.shutdown()
    httpd.server_close()


def _file_url(server, kind: str, name: str) -> str:
    return f"{server.base_url}/crawl-data/{CRAWL}/segments/1716000000000.0/{kind}/{name}"


def _original(server, url: str) -> bytes:
    return (server.root / url.removeprefix(server.base_url + "/")).read_bytes()


# --- the source syntax -------------------------------------------------------------------------

def test_parse_source():
    assert CommonCrawlSource.parse("cc:CC-MAIN-2024-22") == CommonCrawlSource(crawl_id="CC-MAIN-2024-22")
    src = CommonCrawlSource.parse("cc:CC-MAIN-2024-22?files=2&kind=wet&seed=7")
    assert (src.crawl_id, src.files, src.kind, src.seed) == ("CC-MAIN-2024-22", 2, "wet", 7)
    assert src.paths_url("http://mirror/") == \
        "http://mirror/crawl-data/CC-MAIN-2024-22/wet.paths.gz"
    bad = {"cc:CC-MAIN-2024-22?files=0": "files must be an integer >= 1",
           "cc:CC-MAIN-2024-22?files=two": "files must be",
           "cc:CC-MAIN-2024-22?kind=wat": "kind must be one of",
           "cc:CC-MAIN-2024-22?seed=-1": "seed must be",
           "cc:CC-MAIN-2024-22?limit=3": "unknown option.*limit",
           "cc:CC-MAIN-2024-22?files": "expected key=value",
           "cc:../../etc": "crawl id",
           "CC-MAIN-2024-22": "starts with 'cc:'"}
    for source, message in bad.items():
        with pytest.raises(ValueError, match=message) as info:
            CommonCrawlSource.parse(source)
        assert repr(source) in str(info.value)


def test_choose_first_or_seeded_sample():
    paths = [f"p{i}" for i in range(100)]
    assert CommonCrawlSource(crawl_id="CC-MAIN-X", files=3).choose(paths) == ["p0", "p1", "p2"]
    seeded = CommonCrawlSource(crawl_id="CC-MAIN-X", files=5, seed=1)
    sample = seeded.choose(paths)
    assert sample == seeded.choose(list(paths))  # same seed, same files
    assert len(set(sample)) == 5 and set(sample) <= set(paths)
    assert sample == sorted(sample, key=paths.index) != paths[:5]  # listing order, spread out
    assert CommonCrawlSource(crawl_id="CC-MAIN-X", files=5, seed=2).choose(paths) != sample
    with pytest.raises(ValueError, match="files=101 but the warc listing has 100"):
        CommonCrawlSource(crawl_id="CC-MAIN-X", files=101).choose(paths)


# --- fetching ----------------------------------------------------------------------------------

def test_fetch_reads_back_identically(server, shared_data, tmp_path):
    src = CommonCrawlSource.parse(f"cc:{CRAWL}?files=2")
    dest = tmp_path / "downloads"
    paths = cc.fetch(src, dest, server.base_url, **FAST)
    assert [p.name for p in paths] == ["whirlwind.warc.gz", "sample-0000.warc.gz"]
    assert paths[0] == dest / "crawl-data" / CRAWL / "segments/1716000000000.0/warc" / \
        "whirlwind.warc.gz"
    for path, (_, source) in zip(paths, WARC_FILES):
        original = shared_data / "warc" / source
        assert path.read_bytes() == original.read_bytes()
        docs = [e.url for e in read_file(path) if isinstance(e, RawDoc)]
        assert docs == [e.url for e in read_file(original) if isinstance(e, RawDoc)]
        assert len(docs) >= 1
    assert not list(dest.rglob("*.part"))
    n_requests = len(server.requests)
    assert cc.fetch(src, dest, server.base_url, **FAST) == paths  # a re-run only re-lists
    assert server.requests[n_requests:] == [(f"/crawl-data/{CRAWL}/warc.paths.gz", None)]


def test_fetch_wet_and_seeded_sample(server, tmp_path):
    wet = cc.fetch(CommonCrawlSource.parse(f"cc:{CRAWL}?kind=wet"), tmp_path / "d",
                   server.base_url, **FAST)
    assert [p.name for p in wet] == ["whirlwind.warc.wet.gz"]
    assert [e.url for e in read_file(wet[0]) if isinstance(e, RawDoc)] == \
        ["https://an.wikipedia.org/wiki/Escopete"]
    src = CommonCrawlSource.parse(f"cc:{CRAWL}?files=2&seed=3")
    urls = cc.list_files(src, server.base_url, **FAST)
    names = [name for name, _ in WARC_FILES]
    chosen = [u.rsplit("/", 1)[1] for u in urls]
    assert urls == cc.list_files(src, server.base_url, **FAST)
    assert len(chosen) == 2 and chosen == sorted(chosen, key=names.index)


def test_dropped_connection_resumes_with_range(server, tmp_path):
    url = _file_url(server, "warc", "sample-0001.warc.gz")
    server.faults[url.removeprefix(server.base_url)] = Counter(drop=2)
    dest = cc.download(url, tmp_path / "x.warc.gz", **FAST)
    assert dest.read_bytes() == _original(server, url)
    ranges = [r for _, r in server.requests if r is not None]
    size = len(_original(server, url))
    # 1st: whole file, cut at half; 2nd: from half, cut at half of the rest; 3rd: the rest
    assert ranges == [f"bytes={size // 2}-", f"bytes={size // 2 + (size - size // 2) // 2}-"]


def test_partial_file_resumes_and_server_without_range(server, tmp_path):
    url = _file_url(server, "warc", "sample-0000.warc.gz")
    original = _original(server, url)
    part = tmp_path / "y.warc.gz.part"
    part.write_bytes(original[:1000])  # left by a killed run
    assert cc.download(url, tmp_path / "y.warc.gz", **FAST).read_bytes() == original
    assert server.requests == [(url.removeprefix(server.base_url), "bytes=1000-")]
    server.ignore_range = True  # a server that always sends the whole file: start again
    part = tmp_path / "z.warc.gz.part"
    part.write_bytes(original[:1000])
    assert cc.download(url, tmp_path / "z.warc.gz", **FAST).read_bytes() == original
    complete = tmp_path / "w.warc.gz.part"  # killed after the last byte, before the rename
    complete.write_bytes(original)
    server.ignore_range = False
    assert cc.download(url, tmp_path / "w.warc.gz", **FAST).read_bytes() == original


def test_503_twice_then_200(server, tmp_path):
    url = _file_url(server, "warc", "example.warc.gz")
    server.faults[url.removeprefix(server.base_url)] = Counter({"503": 2})
    assert cc.download(url, tmp_path / "e.warc.gz", **FAST).read_bytes() == \
        _original(server, url)
    assert len(server.requests) == 3
    server.faults[url.removeprefix(server.base_url)] = Counter({"503": 10})
    with pytest.raises(DownloadError, match=f"{url}: giving up after 3 retries: HTTP 503"):
        cc.download(url, tmp_path / "f.warc.gz", **FAST)
    assert len(server.requests) == 3 + 4  # one try and three retries


def test_corrupt_download_refetched_once_then_error(server, tmp_path):
    url = _file_url(server, "warc", "sample-0000.warc.gz")
    path = url.removeprefix(server.base_url)
    server.faults[path] = Counter(corrupt=1)
    assert cc.download(url, tmp_path / "a.warc.gz", **FAST).read_bytes() == \
        _original(server, url)
    assert len(server.requests) == 2
    server.faults[path] = Counter(corrupt=2)
    with pytest.raises(DownloadError, match=f"{url}: corrupt download, twice: gzip integrity"):
        cc.download(url, tmp_path / "b.warc.gz", **FAST)
    assert len(server.requests) == 4
    assert not (tmp_path / "b.warc.gz").exists() and not (tmp_path / "b.warc.gz.part").exists()


def test_missing_listing_and_file_name_the_url(server, tmp_path):
    listing = f"{server.base_url}/crawl-data/CC-MAIN-NOPE/warc.paths.gz"
    with pytest.raises(DownloadError, match=f"{listing}: HTTP 404.*CC-MAIN-NOPE") as info:
        cc.list_files(CommonCrawlSource.parse("cc:CC-MAIN-NOPE"), server.base_url, **FAST)
    assert info.value.status == 404
    assert len(server.requests) == 1  # a 404 is not retried
    missing = f"{server.base_url}/crawl-data/{CRAWL}/segments/nothing.warc.gz"
    with pytest.raises(DownloadError, match=f"{missing}: HTTP 404"):
        cc.download(missing, tmp_path / "n.warc.gz", **FAST)
    with pytest.raises(ValueError, match="files=9 but the warc listing has 4"):
        cc.list_files(CommonCrawlSource.parse(f"cc:{CRAWL}?files=9"), server.base_url, **FAST)


def test_unreachable_server_gives_up(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/crawl-data/{CRAWL}/warc.paths.gz"
    with pytest.raises(DownloadError, match=f"{url}: giving up after 3 retries"):
        cc.list_files(CommonCrawlSource.parse(f"cc:{CRAWL}"), f"http://127.0.0.1:{port}",
                      **FAST)


def test_verify(shared_data, tmp_path):
    original = (shared_data / "warc" / "warcio_examples" / "example.warc.gz").read_bytes()
    path = tmp_path / "a.warc.gz"
    path.write_bytes(original)
    assert cc.verify(path, len(original)) is None
    assert cc.verify(path, len(original) + 1) == \
        f"{len(original)} bytes on disk, server said {len(original) + 1}"
    path.write_bytes(original[:-100])
    assert cc.verify(path).startswith("gzip integrity check failed")
    assert cc.verify(path, gzipped=False) is None
