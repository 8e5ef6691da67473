"""Common Crawl collector against a local HTTP server: listing, choice of files, downloads that
resume with Range, retries, verification, and clear errors."""
from __future__ import annotations

import time
from collections import Counter

import pytest
from corpus_helpers import CRAWL, WARC_FILES

import gristmill.tasks.collect.read.common_crawl as cc
from gristmill.core.stage import InputError
from gristmill.tasks.collect.read.common_crawl import CommonCrawlSource, DownloadError, UnknownCrawl
from gristmill.tasks.collect.read.readers import RawDoc, read_file

FAST = {"retries": 3, "timeout_s": 5.0, "backoff_s": 0.01}  # tests must not sleep for seconds








def _file_url(crawl_server, kind: str, name: str) -> str:
    return f"{crawl_server.base_url}/crawl-data/{CRAWL}/segments/1716000000000.0/{kind}/{name}"


def _original(crawl_server, url: str) -> bytes:
    return (crawl_server.root / url.removeprefix(crawl_server.base_url + "/")).read_bytes()


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
           "cc:NOTACRAWL": "crawl id 'NOTACRAWL' cannot be a Common Crawl crawl",
           "cc:CC-MAIN-1999-01": "crawl id 'CC-MAIN-1999-01' cannot be",  # the first crawls are of 2013
           "cc:CC-MAIN-2012-40": "cannot be",
           f"cc:CC-MAIN-{time.gmtime().tm_year + 1}-10": "cannot be",  # not crawled yet
           "cc:CC-MAIN-2024-00": "cannot be",
           "cc:CC-MAIN-2024-54": "cannot be",  # ISO weeks: 01-53
           "cc:CC-MAIN-2024-2": "cannot be",
           "cc:CC-MAIN-2024-22?kind=zip": "kind must be one of",
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

def test_fetch_reads_back_identically(crawl_server, shared_data, tmp_path):
    src = CommonCrawlSource.parse(f"cc:{CRAWL}?files=2")
    dest = tmp_path / "downloads"
    paths = cc.fetch(src, dest, crawl_server.base_url, **FAST)
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
    n_requests = len(crawl_server.requests)
    assert cc.fetch(src, dest, crawl_server.base_url, **FAST) == paths  # a re-run only re-lists
    assert crawl_server.requests[n_requests:] == [(f"/crawl-data/{CRAWL}/warc.paths.gz", None)]


def test_fetch_wet_and_seeded_sample(crawl_server, tmp_path):
    wet = cc.fetch(CommonCrawlSource.parse(f"cc:{CRAWL}?kind=wet"), tmp_path / "d",
                   crawl_server.base_url, **FAST)
    assert [p.name for p in wet] == ["whirlwind.warc.wet.gz"]
    assert [e.url for e in read_file(wet[0]) if isinstance(e, RawDoc)] == \
        ["https://an.wikipedia.org/wiki/Escopete"]
    src = CommonCrawlSource.parse(f"cc:{CRAWL}?files=2&seed=3")
    urls = cc.list_files(src, crawl_server.base_url, **FAST)
    names = [name for name, _ in WARC_FILES]
    chosen = [u.rsplit("/", 1)[1] for u in urls]
    assert urls == cc.list_files(src, crawl_server.base_url, **FAST)
    assert len(chosen) == 2 and chosen == sorted(chosen, key=names.index)


def test_dropped_connection_resumes_with_range(crawl_server, tmp_path):
    url = _file_url(crawl_server, "warc", "sample-0001.warc.gz")
    crawl_server.faults[url.removeprefix(crawl_server.base_url)] = Counter(drop=2)
    dest = cc.download(url, tmp_path / "x.warc.gz", **FAST)
    assert dest.read_bytes() == _original(crawl_server, url)
    ranges = [r for _, r in crawl_server.requests if r is not None]
    size = len(_original(crawl_server, url))
    # 1st: whole file, cut at half; 2nd: from half, cut at half of the rest; 3rd: the rest
    assert ranges == [f"bytes={size // 2}-", f"bytes={size // 2 + (size - size // 2) // 2}-"]


def test_partial_file_resumes_and_server_without_range(crawl_server, tmp_path):
    url = _file_url(crawl_server, "warc", "sample-0000.warc.gz")
    original = _original(crawl_server, url)
    part = tmp_path / "y.warc.gz.part"
    part.write_bytes(original[:1000])  # left by a killed run
    assert cc.download(url, tmp_path / "y.warc.gz", **FAST).read_bytes() == original
    assert crawl_server.requests == [(url.removeprefix(crawl_server.base_url), "bytes=1000-")]
    crawl_server.ignore_range = True  # a crawl_server that always sends the whole file: start again
    part = tmp_path / "z.warc.gz.part"
    part.write_bytes(original[:1000])
    assert cc.download(url, tmp_path / "z.warc.gz", **FAST).read_bytes() == original
    complete = tmp_path / "w.warc.gz.part"  # killed after the last byte, before the rename
    complete.write_bytes(original)
    crawl_server.ignore_range = False
    assert cc.download(url, tmp_path / "w.warc.gz", **FAST).read_bytes() == original


def test_503_twice_then_200(crawl_server, tmp_path):
    url = _file_url(crawl_server, "warc", "example.warc.gz")
    crawl_server.faults[url.removeprefix(crawl_server.base_url)] = Counter({"503": 2})
    assert cc.download(url, tmp_path / "e.warc.gz", **FAST).read_bytes() == \
        _original(crawl_server, url)
    assert len(crawl_server.requests) == 3
    crawl_server.faults[url.removeprefix(crawl_server.base_url)] = Counter({"503": 10})
    with pytest.raises(DownloadError, match=f"{url}: giving up after 3 retries: HTTP 503"):
        cc.download(url, tmp_path / "f.warc.gz", **FAST)
    assert len(crawl_server.requests) == 3 + 4  # one try and three retries


def test_corrupt_download_refetched_once_then_error(crawl_server, tmp_path):
    url = _file_url(crawl_server, "warc", "sample-0000.warc.gz")
    path = url.removeprefix(crawl_server.base_url)
    crawl_server.faults[path] = Counter(corrupt=1)
    assert cc.download(url, tmp_path / "a.warc.gz", **FAST).read_bytes() == \
        _original(crawl_server, url)
    assert len(crawl_server.requests) == 2
    crawl_server.faults[path] = Counter(corrupt=2)
    with pytest.raises(DownloadError, match=f"{url}: corrupt download, twice: gzip integrity"):
        cc.download(url, tmp_path / "b.warc.gz", **FAST)
    assert len(crawl_server.requests) == 4
    assert not (tmp_path / "b.warc.gz").exists() and not (tmp_path / "b.warc.gz.part").exists()


def test_missing_listing_and_file_name_the_url(crawl_server, tmp_path):
    """A well-formed crawl id the server has no listing for is the user's input: an InputError,
    which a run reports in one line (exit 2)."""
    listing = f"{crawl_server.base_url}/crawl-data/CC-MAIN-2019-03/warc.paths.gz"
    with pytest.raises(UnknownCrawl, match=f"{listing}: HTTP 404.*'CC-MAIN-2019-03'") as info:
        cc.list_files(CommonCrawlSource.parse("cc:CC-MAIN-2019-03"), crawl_server.base_url, **FAST)
    assert info.value.status == 404
    assert isinstance(info.value, InputError) and isinstance(info.value, DownloadError)
    assert len(crawl_server.requests) == 1  # a 404 is not retried
    missing = f"{crawl_server.base_url}/crawl-data/{CRAWL}/segments/nothing.warc.gz"
    with pytest.raises(DownloadError, match=f"{missing}: HTTP 404"):
        cc.download(missing, tmp_path / "n.warc.gz", **FAST)
    with pytest.raises(ValueError, match="files=9 but the warc listing has 4"):
        cc.list_files(CommonCrawlSource.parse(f"cc:{CRAWL}?files=9"), crawl_server.base_url, **FAST)


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
