"""Readers: every input format, fsspec paths, non-document records counted by type, and bad
input of every kind skipped or quarantined with a counted reason while reading completes."""
from __future__ import annotations

import gzip
import io
import json
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from gristmill.core.files import file_digest
from gristmill.core.sources import input_digest
from gristmill.tasks.collect.read.readers import (
    FILE_LEVEL_ERRORS,
    RawDoc,
    Skipped,
    decode_text,
    is_binary,
    quarantine_record,
    read_file,
    resolve_source,
)

MB = 1_000_000


def _split(events) -> tuple[Counter, list[RawDoc], list[Skipped]]:
    reasons, docs, skipped = Counter(), [], []
    for event in events:
        if isinstance(event, Skipped):
            reasons[event.reason] += 1
            skipped.append(event)
        else:
            docs.append(event)
    return reasons, docs, skipped


def _read(path, **kwargs) -> tuple[Counter, list[RawDoc], list[Skipped]]:
    return _split(read_file(path, **kwargs))


@pytest.fixture(scope="module")
def dolma_jsonl(shared_data) -> Path:
    return shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0091.jsonl"


@pytest.fixture(scope="module")
def html_page(shared_data) -> bytes:
    """The real example.com page from warcio's example WARC."""
    _, docs, _ = _read(shared_data / "warc" / "warcio_examples" / "example.warc.gz")
    return docs[0].payload


# --- sources -----------------------------------------------------------------------------------

def test_resolve_local_file_url_and_glob(shared_data):
    folder = shared_data / "warc" / "warcio_examples"
    expected = [folder / "example-digest.warc", folder / "example.warc.gz"]
    assert resolve_source(str(folder)) == expected
    assert resolve_source(f"file://{folder}") == expected
    assert resolve_source(str(shared_data / "warc" / "**" / "*.wet.gz")) == \
        [shared_data / "warc" / "commoncrawl_whirlwind" / "whirlwind.warc.wet.gz"]


def test_missing_or_unusable_source_is_named(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("no input here")
    (tmp_path / "table.csv").write_text("a,b\n")
    cases = {str(tmp_path / "nowhere"): "does not exist",
             str(tmp_path / "nowhere" / "*.jsonl"): "matches no input files",
             f"memory://{uuid.uuid4().hex}/x.jsonl": "does not exist",
             str(tmp_path / "notes"): "directory holds no input files",
             str(tmp_path / "table.csv"): "unsupported file type",
             "foo://bucket/x.jsonl": "Protocol not known"}
    for source, message in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            resolve_source(source)
        assert repr(source) in str(info.value)


def test_memory_filesystem_reads_like_local(shared_data, dolma_jsonl):
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/corpus-{uuid.uuid4().hex}"
    local = [shared_data / "warc" / "commoncrawl_whirlwind" / "whirlwind.warc.gz",
             shared_data / "warc" / "warcio_examples" / "example-digest.warc", dolma_jsonl]
    try:
        for i, path in enumerate(local):
            fs.pipe(f"{root}/part{i}/{path.name}", path.read_bytes())
        urls = resolve_source(f"memory://{root}")
        assert urls == [f"memory://{root}/part{i}/{p.name}" for i, p in enumerate(local)]
        assert resolve_source(f"memory://{root}/**/*.jsonl") == urls[2:]
        for url, path in zip(urls, local):
            reasons, docs, _ = _read(url)
            local_reasons, local_docs, _ = _read(path)
            assert reasons == local_reasons
            assert [(d.url, d.payload) for d in docs] == \
                [(d.url, d.payload) for d in local_docs]
        assert len(_read(urls[0])[1]) == 1 and len(_read(urls[2])[1]) == 10
        digest = input_digest(urls[2])
        assert digest.startswith("memory:") and input_digest(urls[2]) == digest
        fs.pipe(f"{root}/part2/{dolma_jsonl.name}", dolma_jsonl.read_bytes() + b"\n")
        assert input_digest(urls[2]) != digest
        assert input_digest(dolma_jsonl) == file_digest(dolma_jsonl)
    finally:
        fs.rm(root, recursive=True)


# --- formats -----------------------------------------------------------------------------------

def test_jsonl_zstd_like_plain_and_damaged_zstd(dolma_jsonl, tmp_path):
    import zstandard

    data = dolma_jsonl.read_bytes()
    half = data.index(b"\n", len(data) // 2) + 1
    compressor = zstandard.ZstdCompressor()
    frames = compressor.compress(data[:half]) + compressor.compress(data[half:])  # two frames
    (tmp_path / "docs.jsonl.zst").write_bytes(frames)
    _, plain, _ = _read(dolma_jsonl)
    reasons, docs, _ = _read(tmp_path / "docs.jsonl.zst")
    assert not reasons and [d.payload for d in docs] == [d.payload for d in plain]
    (tmp_path / "cut.jsonl.zst").write_bytes(frames[: len(frames) * 3 // 4])
    reasons, docs, _ = _read(tmp_path / "cut.jsonl.zst")
    assert reasons == {"error_truncated_zstd": 1} and 0 < len(docs) < 10
    (tmp_path / "junk.jsonl.zst").write_bytes(b"this is not zstd at all\n" * 4)
    assert _read(tmp_path / "junk.jsonl.zst")[0] == {"error_corrupt_zstd": 1}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_parquet_and_arrow_like_jsonl(dolma_jsonl, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(_records(dolma_jsonl))
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=3)
    with pa.ipc.new_file(tmp_path / "docs.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=4)
    _, expected, _ = _read(dolma_jsonl)
    for name in ("docs.parquet", "docs.arrow"):
        reasons, docs, _ = _read(tmp_path / name)
        assert not reasons
        assert [(d.url, d.payload) for d in docs] == [(d.url, d.payload) for d in expected]
        assert docs[3].where == f"{tmp_path / name}#3"
    pq.write_table(table.drop_columns(["text"]), tmp_path / "notext.parquet")
    reasons, _, skipped = _read(tmp_path / "notext.parquet")
    assert reasons == {"error_no_text_column": 1} and "columns: " in skipped[0].where
    data = (tmp_path / "docs.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    assert _read(tmp_path / "cut.parquet")[0] == {"error_corrupt_parquet": 1}
    (tmp_path / "junk.arrow").write_bytes(b"not arrow " * 10)
    assert _read(tmp_path / "junk.arrow")[0] == {"error_corrupt_arrow": 1}


def test_datasets_save_to_disk_folder(dolma_jsonl, tmp_path):
    import datasets

    rows = [{"text": r["text"], "url": r["metadata"]["url"]} for r in _records(dolma_jsonl)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"), num_shards=2)
    files = resolve_source(str(tmp_path / "ds"))
    assert [f.name for f in files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    docs = [d for f in files for d in _read(f)[1]]
    loaded = datasets.load_from_disk(str(tmp_path / "ds"))
    assert [d.payload for d in docs] == loaded["text"] and len(docs) == 10
    assert [d.url for d in docs] == loaded["url"]


def test_plain_text_folder(shared_data, tmp_path):
    folder = shared_data / "corpus" / "nltk_inaugural"
    files = resolve_source(str(folder))  # the README (no suffix) is not an input
    assert len(files) == 59 and files[0].name == "1789-Washington.txt"
    reasons, docs, _ = _read(files[0])
    assert not reasons and docs[0].url == str(files[0]) and not docs[0].is_html
    assert decode_text(docs[0].payload, None) == files[0].read_text(encoding="utf-8")
    french = shared_data / "corpus" / "nltk_genesis" / "french.txt"  # ISO-8859-1, not UTF-8
    _, docs, _ = _read(french)
    assert "Au commencement, Dieu créa les cieux et la terre." in \
        decode_text(docs[0].payload, None)
    (tmp_path / "poem.txt.gz").write_bytes(gzip.compress(files[0].read_bytes()))
    assert _read(tmp_path / "poem.txt.gz")[1][0].payload == files[0].read_bytes()


# --- WARC records that are not documents --------------------------------------------------------

def _http(status: str, content_type: str):
    from warcio.statusandheaders import StatusAndHeaders

    return StatusAndHeaders(status, [("Content-Type", content_type)], protocol="HTTP/1.1")


def _warc(path: Path, records: list[tuple], gzipped: bool = True) -> Path:
    """records: (type, http status or None, content type, payload bytes)."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as f:
        writer = WARCWriter(f, gzip=gzipped)
        for i, (rec_type, status, content_type, payload) in enumerate(records):
            uri = f"http://example.com/{i}"
            if rec_type == "revisit":
                record = writer.create_revisit_record(uri, "sha1:AAAA", uri, "2024-05-17T00:00:00Z",
                                                      http_headers=_http(status, content_type))
            elif rec_type == "request":
                record = writer.create_warc_record(uri, "request", payload=io.BytesIO(b""),
                                                   http_headers=StatusAndHeaders(
                                                       "GET / HTTP/1.1", [("Host", "example.com")],
                                                       is_http_request=True))
            elif status is None:
                record = writer.create_warc_record(uri, rec_type, payload=io.BytesIO(payload),
                                                   warc_content_type=content_type)
            else:
                record = writer.create_warc_record(uri, rec_type, payload=io.BytesIO(payload),
                                                   http_headers=_http(status, content_type))
            writer.write_record(record)
    return path


def test_non_document_records_counted_by_type(html_page, tmp_path):
    path = _warc(tmp_path / "mixed.warc.gz", [
        ("request", None, "", b""),
        ("response", "200 OK", "text/html; charset=UTF-8", html_page),
        ("response", "200 OK", "image/png", b"\x89PNG\r\n\x1a\n" + bytes(200)),
        ("response", "200 OK", "text/css", b"body { color: red }"),
        ("response", "200 OK", "application/javascript", b"var x = 1;"),
        ("response", "404 Not Found", "text/html", html_page),
        ("response", "301 Moved Permanently", "text/html", b""),
        ("response", "200 OK", "text/html", b""),
        ("response", "200 OK", "text/html", b"  \r\n "),
        ("revisit", "200 OK", "text/html", b""),
        ("metadata", None, "application/warc-fields", b"fetchTimeMs: 12\r\n"),
        ("resource", None, "text/plain", b"a resource record"),
    ])
    reasons, docs, skipped = _read(path)
    assert reasons == {"skipped_record_request": 1, "skipped_mime_image": 1,
                       "skipped_mime_css": 1, "skipped_mime_javascript": 1,
                       "skipped_http_4xx": 1, "skipped_http_3xx": 1,
                       "skipped_empty_payload": 2, "skipped_record_revisit": 1,
                       "skipped_record_metadata": 1, "skipped_record_resource": 1}
    assert [(d.url, d.is_html, d.charset) for d in docs] == \
        [("http://example.com/1", True, "utf-8")]
    assert docs[0].payload == html_page and docs[0].where.startswith(f"{path}@")
    assert all(s.sample is None for s in skipped)  # only errors and binary are quarantined


# --- robustness ----------------------------------------------------------------------------------

def test_corrupt_gzip_member_is_skipped_and_reading_resumes(shared_data, tmp_path):
    original = shared_data / "warc" / "dolma_wget" / "sample-0000.warc.gz"
    data = bytearray(original.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 50] = bytes(50)
    bad = tmp_path / "bad.warc.gz"
    bad.write_bytes(bytes(data))
    _, good_docs, _ = _read(original)
    reasons, docs, skipped = _read(bad)
    assert reasons["error_corrupt_warc"] == 1 and len(good_docs) == 22
    assert len(docs) == 21 and docs[-1].url == good_docs[-1].url  # only the damaged one lost
    error = next(s for s in skipped if s.reason == "error_corrupt_warc")
    offset = int(error.where.rsplit("@", 1)[1])
    assert offset < middle and error.sample == bytes(data[offset:offset + 512])
    assert error.sample.startswith(b"\x1f\x8b\x08")  # the damaged member's start


def test_garbled_record_header_in_plain_warc(shared_data, tmp_path):
    plain = gzip.decompress(
        (shared_data / "warc" / "commoncrawl_whirlwind" / "whirlwind.warc.gz").read_bytes())
    second = plain.index(b"WARC/1.0", 1)  # the request record, after warcinfo
    bad = tmp_path / "bad.warc"
    bad.write_bytes(plain[:second] + b"XXXX" + plain[second + 4:])
    reasons, docs, skipped = _read(bad)
    assert reasons == {"skipped_record_warcinfo": 1, "error_corrupt_warc": 1,
                       "skipped_record_metadata": 1}
    assert [d.url for d in docs] == ["https://an.wikipedia.org/wiki/Escopete"]
    assert skipped[1].where == f"{bad}@{second}" and skipped[1].sample.startswith(b"XXXX/1.0")
    assert {"error_corrupt_warc", "error_truncated_zstd"} <= FILE_LEVEL_ERRORS


def test_truncated_text_gz(shared_data, tmp_path):
    data = gzip.compress((shared_data / "corpus" / "botchan_en.txt").read_bytes())
    (tmp_path / "cut.txt.gz").write_bytes(data[: len(data) // 2])
    reasons, _, skipped = _read(tmp_path / "cut.txt.gz")
    assert reasons == {"error_truncated_gzip": 1}
    # quarantined with the end of the file, where it was cut, as the sample to look at
    assert skipped[0].sample == data[: len(data) // 2][-512:] and skipped[0].where == str(tmp_path / "cut.txt.gz")


def test_bad_lines_are_quarantined(dolma_jsonl, tmp_path):
    good = dolma_jsonl.read_bytes().splitlines()[0]
    lines = [b"this is not json", b'{"text": "caf\xe9 \xff"}', b"[1, 2]", good, b"", b"{"]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    reasons, docs, skipped = _read(bad)
    assert reasons == {"error_bad_json": 2, "error_invalid_utf8": 1, "error_missing_text": 1}
    starts = [sum(len(line) + 1 for line in lines[:i]) for i in range(len(lines))]  # byte offsets
    assert len(docs) == 1 and docs[0].where == f"{bad}@{starts[3]}"
    assert [(s.where, s.sample) for s in skipped] == [
        (f"{bad}@0", b"this is not json\n"), (f"{bad}@{starts[1]}", b'{"text": "caf\xe9 \xff"}\n'),
        (f"{bad}@{starts[2]}", b"[1, 2]\n"), (f"{bad}@{starts[5]}", b"{\n")]
    assert json.loads(json.dumps(quarantine_record(skipped[1]))) == {
        "reason": "error_invalid_utf8", "where": f"{bad}@17", "nbytes": 19,
        "sample": '{"text": "caf\\xe9 \\xff"}\n'}


def test_empty_files_of_every_format(tmp_path):
    names = ["a.warc.gz", "b.warc", "c.jsonl", "d.jsonl.zst", "e.parquet", "f.arrow", "g.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
        reasons, docs, skipped = _read(tmp_path / name)
        assert reasons == {"error_empty_file": 1} and docs == []
        assert skipped[0].where == str(tmp_path / name)
    assert len(resolve_source(str(tmp_path))) == len(names)


def test_fifty_megabyte_documents_are_skipped_fast(html_page, tmp_path):
    started = time.perf_counter()
    big_text = b"word " * (50 * MB // 5)
    jsonl = tmp_path / "big.jsonl"
    with open(jsonl, "wb") as f:
        f.write(b'{"text": "' + big_text + b'"}\n{"text": "small"}\n')
    reasons, docs, skipped = _read(jsonl)
    assert reasons == {"skipped_too_large": 1} and [d.payload for d in docs] == ["small"]
    assert skipped[0].nbytes == len(big_text) + 13 and skipped[0].where == f"{jsonl}@0"
    warc = _warc(tmp_path / "big.warc", [("response", "200 OK", "text/html", big_text),
                                         ("response", "200 OK", "text/html", html_page)],
                 gzipped=False)
    reasons, docs, _ = _read(warc)
    assert reasons == {"skipped_too_large": 1} and len(docs) == 1
    (tmp_path / "big.txt").write_bytes(big_text)
    reasons, _, skipped = _read(tmp_path / "big.txt")
    assert reasons == {"skipped_too_large": 1} and skipped[0].nbytes == len(big_text)
    assert time.perf_counter() - started < 10  # ~1.2 s measured on 2 shared cores


def test_max_doc_bytes_is_configurable(dolma_jsonl):
    sizes = [len(line) + 1 for line in dolma_jsonl.read_bytes().splitlines()]
    cap = sorted(sizes)[4]
    reasons, docs, _ = _read(dolma_jsonl, max_doc_bytes=cap)
    assert reasons == {"skipped_too_large": sum(s > cap for s in sizes)} == {"skipped_too_large": 5}
    assert len(docs) == 5 and all(d.nbytes <= cap for d in docs)


def test_binary_content_is_quarantined(shared_data, html_page, tmp_path):
    warc_bytes = (shared_data / "warc" / "warcio_examples" / "example.warc.gz").read_bytes()
    (tmp_path / "image.txt").write_bytes(warc_bytes)  # gzip data named .txt
    reasons, _, skipped = _read(tmp_path / "image.txt")
    assert reasons == {"skipped_binary": 1} and skipped[0].sample == warc_bytes[:512]
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4
    warc = _warc(tmp_path / "mislabelled.warc.gz", [("response", "200 OK", "text/html", png),
                                                    ("response", "200 OK", "text/html", html_page)])
    reasons, docs, skipped = _read(warc)
    assert reasons == {"skipped_binary": 1} and len(docs) == 1
    assert skipped[0].sample == png[:512] and skipped[0].where.startswith(f"{warc}@")
    (tmp_path / "nul.jsonl").write_text(json.dumps({"text": "a\u0000b" * 100}) + "\n")
    assert _read(tmp_path / "nul.jsonl")[0] == {"skipped_binary": 1}


def test_binary_detection_spares_text_in_any_charset(shared_data):
    japanese = (shared_data / "corpus" / "wagahaiwa_nekodearu_ja.txt").read_text()[:3000]
    for encoding in ("utf-8", "shift_jis", "euc_jp", "iso2022_jp"):
        assert not is_binary(japanese.encode(encoding)), encoding
    assert not is_binary((shared_data / "corpus" / "nltk_genesis" / "french.txt").read_bytes())
    assert not is_binary("tab\tseparated\r\nform\ffeed") and not is_binary(b"")
    assert is_binary(gzip.compress(japanese.encode()))
    assert is_binary(bytes(range(1, 32)) * 10 + b"text" * 100)  # control bytes, no NUL
