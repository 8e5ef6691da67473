"""Damaged and odd input files of every kind the collect stage's readers meet, for fuzzing them
(fuzz.py beside this one, tests/tasks/collect/test_fuzz.py,
tests/tasks/collect/test_collect_units.py): one generator per fault kind in FAULTS,
`KIND(rng, texts) -> FuzzFile`, each drawing everything from `rng`, so a seed gives
the same bytes (gzip with mtime 0, zstd, Parquet/Arrow written in memory). The generators are one
table of fault kinds that reads better whole than split.
"""
from __future__ import annotations

import gzip
import io
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_DOC_BYTES = 1_000_000  # the trials' max_doc_bytes: huge lines straddle it without 10 MB each
BOM = b"\xef\xbb\xbf"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAGICS = (b"", b"\x1f\x8b\x08", ZSTD_MAGIC, b"PAR1", b"ARROW1\x00\x00", b"WARC/1.0\r\n",
          b'{"text": "', BOM)
SUFFIXES = (".warc", ".warc.gz", ".wet", ".wet.gz", ".jsonl", ".jsonl.gz", ".json.gz",
            ".jsonl.zst", ".jsonl.zstd", ".json.zst", ".parquet", ".arrow", ".txt", ".txt.gz",
            ".txt.zst")  # tasks.collect.read.readers.SUPPORTED_SUFFIXES, kept here to import nothing heavy
# Prose that passes the default cleaning chain: the trial's intact documents.
PROSE = (
    "The old mill stood at the bend of the river, where the water ran fast enough to turn the "
    "great wheel through the whole year. Farmers from the valley brought their grain in carts, "
    "and the miller weighed each sack before he poured it into the hopper.\n"
    "Grinding was slow work, and the miller had to watch the stones with great care. If they "
    "ran too close together, the flour would burn and taste of smoke; if they ran too far "
    "apart, the grain would pass through whole and the farmer would complain about it.\n"
    "In the spring the river rose over its banks, and the mill often stood idle for a week or "
    "more while the water was too high for the wheel. The miller used that time to mend the "
    "belts, to dress the stones, and to repair the wooden gears that had cracked in the winter.\n"
    "By the end of the century, steam engines had replaced most of the water mills in the "
    "region. The building still stands today, and visitors can walk through the rooms where "
    "the grain was once stored and ground.",
    "A small town library keeps more than books. Its reading room holds the local newspaper "
    "back to the first issue, bound by year, and the librarian can find a wedding notice from "
    "a century ago faster than any search engine.\n"
    "Most visitors come for the children's corner on a Saturday morning, when a volunteer reads "
    "aloud and the room fills with parents who have nowhere else to be. Others come to use the "
    "computers, to print a form for the tax office, or to sit somewhere warm and quiet.\n"
    "The budget is small and it shrinks a little every year. The staff have learned to repair "
    "worn spines with cloth tape, to trade duplicate copies with the next town, and to ask the "
    "council for money in the weeks before an election, when it is most likely to listen.",
    "Weather stations on remote islands are visited only a few times each year. Between visits "
    "the instruments must run on their own, through storms that would tear the roof off an "
    "ordinary shed.\n"
    "The engineers who design them think first about power and water. Solar panels are mounted "
    "at a steep angle so that snow slides off, and every cable enters the box from below, so "
    "that rain running down the wall cannot follow it inside.\n"
    "When a sensor fails, the station keeps sending what it still measures, and a flag in each "
    "message tells the forecasters which readings to ignore. A missing value is far better than "
    "a wrong one, because a wrong one can pass unnoticed into a forecast for weeks.",
)


@dataclass(frozen=True, kw_only=True)
class FuzzFile:
    """One generated input file."""

    kind: str  # the FAULTS entry that made it
    name: str  # file name; its suffix picks the reader
    data: bytes
    records: int | None  # records a reader must report for it; None: unknown (damaged)


# ---------------------------------------------------------------- encoders (deterministic)

def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3).compress(data)


def _compress(data: bytes, name: str) -> bytes:
    if name.endswith(".gz"):
        return _gzip(data)
    return _zstd(data) if name.endswith((".zst", ".zstd")) else data


def _record(rng: random.Random, text: str, i: int) -> dict[str, Any]:
    return {"id": f"fuzz-{rng.randrange(10**9)}-{i}", "text": text,
            "metadata": {"url": f"https://fuzz.example.org/{rng.randrange(10**6)}/{i}"}}


def jsonl(rng: random.Random, texts: Sequence[str]) -> bytes:
    """Intact dolma-style JSON lines of `texts`."""
    return b"".join(json.dumps(_record(rng, t, i)).encode() + b"\n" for i, t in enumerate(texts))


def count_jsonl_records(data: bytes) -> int:
    """Records a JSON-lines reader must report for uncompressed `data`: every line over
    MAX_DOC_BYTES (its newline included), and every other one that is not blank (a UTF-8 BOM
    before the first is not content)."""
    pieces = data.split(b"\n")
    lines = [p + b"\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    return sum(1 for i, line in enumerate(lines) if len(line) > MAX_DOC_BYTES
               or (line.removeprefix(BOM) if i == 0 else line).strip())


def _damage(rng: random.Random, data: bytes) -> bytes:
    """Truncate, flip bytes, zero a stretch, or append or insert garbage."""
    how = rng.choice(("truncate", "flip", "zero", "append", "insert"))
    if how == "truncate" or len(data) < 4:
        return data[:rng.randrange(1, max(2, len(data)))]
    buf = bytearray(data)
    if how == "flip":
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= rng.randrange(1, 256)
    elif how == "zero":
        start = rng.randrange(len(buf))
        end = min(len(buf), start + rng.randint(1, 64))
        buf[start:end] = bytes(end - start)
    elif how == "append":
        buf += rng.randbytes(rng.randint(1, 200))
    else:
        at = rng.randrange(len(buf))
        buf[at:at] = rng.choice((b"", *MAGICS)) + rng.randbytes(rng.randint(1, 64))
    return bytes(buf)


# ---------------------------------------------------------------- WARC records

def _warc_record(headers: list[tuple[bytes, bytes]], block: bytes) -> bytes:
    head = b"WARC/1.0\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
    return head + b"Content-Length: %d\r\n\r\n" % len(block) + block + b"\r\n\r\n"


def _http(status: bytes, content_type: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def warc_records(rng: random.Random, texts: Sequence[str]) -> list[bytes]:
    """2-6 records of the kinds a crawl holds (request, HTML responses, WET text, metadata...)."""
    def html(text: str) -> bytes:
        charset = rng.choice((b"utf-8", b"iso-8859-1", b"bogus-charset", b"utf-16", b""))
        encoding = charset.decode() if charset in (b"utf-8", b"iso-8859-1", b"utf-16") else "utf-8"
        paras = "".join(f"<p>{p}</p>" for p in text.split("\n"))
        body = f"<html><head><title>t</title></head><body>{paras}</body></html>"
        ctype = b"text/html" + (b"; charset=" + charset if charset else b"")
        return _http(b"200 OK", ctype, body.encode(encoding, "replace"))

    def uri() -> bytes:
        return b"https://fuzz.example.org/%d" % rng.randrange(10**6)

    response = [(b"WARC-Type", b"response"), (b"Content-Type", b"application/http; msgtype=response")]
    makers: list[Callable[[], bytes]] = [
        lambda: _warc_record([(b"WARC-Type", b"warcinfo"), (b"Content-Type", b"application/warc-fields")],
                             b"software: fuzz\r\n"),
        lambda: _warc_record([(b"WARC-Type", b"request"), (b"WARC-Target-URI", uri())],
                             b"GET / HTTP/1.1\r\nHost: fuzz.example.org\r\n\r\n"),
        lambda: _warc_record([*response, (b"WARC-Target-URI", uri())], html(rng.choice(texts))),
        lambda: _warc_record([*response, (b"WARC-Target-URI", uri())],
                             _http(b"404 Not Found", b"text/html", b"<html>gone</html>")),
        lambda: _warc_record([*response, (b"WARC-Target-URI", uri())],
                             _http(b"200 OK", b"image/png", b"\x89PNG\r\n\x1a\n" + rng.randbytes(64))),
        lambda: _warc_record([(b"WARC-Type", b"conversion"), (b"WARC-Target-URI", uri()),
                              (b"Content-Type", b"text/plain")], rng.choice(texts).encode()),
        lambda: _warc_record([(b"WARC-Type", b"metadata"), (b"WARC-Target-URI", uri())],
                             b"fetchTimeMs: 12\r\n"),
    ]
    return [rng.choice(makers)() for _ in range(rng.randint(2, 6))]


def _break_header(rng: random.Random, record: bytes) -> bytes:
    """One damaged header (or HTTP status line) of a WARC record."""
    head, sep, block = record.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    how = rng.choice(("length", "version", "no_colon", "bytes", "type", "uri", "status", "encoding",
                      "bare_lf", "huge_header"))
    if how == "length":
        value = rng.choice((b"abc", b"-5", b"99999999999999999999", b"", b"%d" % rng.randrange(10**4)))
        lines = [b"Content-Length: " + value if line.startswith(b"Content-Length") else line
                 for line in lines]
    elif how == "version":
        lines[0] = rng.choice((b"WARC/9.9", b"WARX/1.0", b"", b"HTTP/1.1 200 OK", b"warc/1.0"))
    elif how == "no_colon":
        lines.insert(rng.randint(1, len(lines)), b"This header line has no colon")
    elif how == "bytes":
        lines.insert(rng.randint(1, len(lines)), rng.randbytes(rng.randint(1, 40)).replace(b"\n", b" "))
    elif how == "type":
        lines = [line for line in lines if not line.startswith(b"WARC-Type")]
        lines.insert(1, b"WARC-Type: " + rng.choice((b"bogus", b"", b"RESPONSE", b"resp\xffonse")))
    elif how == "uri":
        lines = [line for line in lines if not line.startswith(b"WARC-Target-URI")]
        if rng.random() < 0.7:
            lines.insert(1, b"WARC-Target-URI: " + rng.choice(
                (b"http://[::1", b"http://ex\xff\xfe.org/", b"javascript:alert(1)", b"x" * 5000)))
    elif how == "status":
        block = rng.choice((b"garbage", b"HTTP/1.1 abc OK", b"HTTP/1.1 999 X", b"", b"HTTP/1.1")) \
            + block[block.find(b"\r\n"):] if block.startswith(b"HTTP/") else block
    elif how == "encoding":
        extra = rng.choice((b"Content-Encoding: gzip\r\n", b"Content-Encoding: deflate\r\n",
                            b"Content-Encoding: br\r\n", b"Transfer-Encoding: chunked\r\n"))
        block = block.replace(b"\r\n", b"\r\n" + extra, 1) if block.startswith(b"HTTP/") else block
    elif how == "bare_lf":
        return b"\n".join(lines) + b"\n\n" + block
    else:
        lines.insert(1, b"X-Huge: " + b"h" * rng.randint(MAX_DOC_BYTES // 2, 2 * MAX_DOC_BYTES))
    return b"\r\n".join(lines) + sep + block


# ---------------------------------------------------------------- the fault kinds

def random_bytes(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    suffix = rng.choice(SUFFIXES)
    data = rng.choice(MAGICS) + rng.randbytes(rng.choice((1, 10, 100, 1000, 10_000, 100_000)))
    records = 1 if suffix == ".txt" else count_jsonl_records(data) if suffix == ".jsonl" else None
    return FuzzFile(kind="random_bytes", name=f"random{suffix}", data=data, records=records)


def empty(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    """A 0-byte file of any format, or an empty stream inside intact compression."""
    suffix = rng.choice(SUFFIXES)
    if rng.random() < 0.5 or not suffix.endswith((".gz", ".zst", ".zstd")):
        return FuzzFile(kind="empty", name=f"empty{suffix}", data=b"", records=0)
    records = 1 if suffix.startswith(".txt") else 0 if "json" in suffix else None
    return FuzzFile(kind="empty", name=f"empty{suffix}", data=_compress(b"", suffix), records=records)


def jsonl_lines(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    """JSON lines of every shape: records, non-objects, no or non-string `text`, odd URLs and
    ids, invalid JSON and UTF-8, lone surrogates, deep nesting, huge numbers, blank lines."""
    def text() -> str:
        t = rng.choice(texts)
        return t[:rng.randrange(len(t) + 1)] if rng.random() < 0.3 else t

    makers: list[Callable[[], bytes]] = [
        lambda: json.dumps(_record(rng, text(), 0)).encode(),
        lambda: rng.choice((b"1", b'"a string"', b"[1, 2]", b"null", b"true", b"1e999", b"NaN")),
        lambda: rng.choice((b'{"id": 1}', b"{}", b'{"txt": "no text field"}')),
        lambda: json.dumps({"text": rng.choice((5, ["a"], {"a": 1}, None, 1.5))}).encode(),
        lambda: json.dumps({"text": text(), "metadata": rng.choice(("x", {"url": 7}, [1], None)),
                            "url": rng.choice((["a"], 3, "", "http://[::1", "u" * 5000)),
                            "id": rng.choice(({"x": 1}, 7, "https://fuzz.example.org/id"))}).encode(),
        lambda: rng.choice((b"{oops", b'{"text": "unterminated', b'{"text": "a",}', b"{'text': 'a'}")),
        lambda: b'{"text": "' + rng.choice((b"caf\xe9", b"\xc0\xaf", b"\xed\xa0\x80", b"\xff")) + b'"}',
        lambda: b'{"text": "%s \\ud800 tail", "url": "http://fuzz.example.org/\\udcff"}'
                % text().encode()[:200].replace(b"\\", b"").replace(b'"', b""),
        lambda: b"[" * 100_000 + b"]" * 100_000,
        lambda: b'{"text": "x", "n": ' + b"9" * 5000 + b"}",
        lambda: b'{"text": "a\x00b"}',
        lambda: json.dumps({"text": "\u0000\u0001" * 200}).encode(),
        lambda: json.dumps({"text": rng.choice(("", "   ", "\n\n"))}).encode(),
        lambda: rng.choice((b"", b"   \t", b"\r")),
        lambda: json.dumps({"text": text()}).encode() + b"\r",
    ]
    lines = [rng.choice(makers)() for _ in range(rng.randint(1, 12))]
    data = (BOM if rng.random() < 0.2 else b"") + b"\n".join(lines) \
        + (b"\n" if rng.random() < 0.7 else b"")
    suffix = rng.choice((".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst"))
    return FuzzFile(kind="jsonl_lines", name=f"lines{suffix}", data=_compress(data, suffix),
                    records=count_jsonl_records(data))


ENCODINGS = ("utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32", "latin-1", "cp1252",
             "shift_jis", "gb18030", "koi8-r")


def encodings(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    """Text in many encodings, with invalid bytes, encoded surrogates, overlong forms and NULs
    sprinkled in: as a text file, or as the raw bytes of JSON strings."""
    def encoded() -> bytes:
        text = rng.choice(texts) + " café naïve façade — “quoted” 日本語 текст"
        data = bytearray(text.encode(rng.choice(ENCODINGS), "replace"))
        for _ in range(rng.choice((0, 1, 5, 50))):
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x00", b"\x80"))
        return bytes(data)

    if rng.random() < 0.5:
        suffix = rng.choice((".txt", ".txt.gz", ".txt.zst"))
        return FuzzFile(kind="encodings", name=f"text{suffix}", data=_compress(encoded(), suffix), records=1)
    lines = [b'{"text": "' + encoded().replace(b"\n", b" ").replace(b"\\", b"/") + b'"}'
             for _ in range(rng.randint(1, 5))]
    data = b"\n".join(lines) + b"\n"
    return FuzzFile(kind="encodings", name="text.jsonl", data=data, records=count_jsonl_records(data))


def huge_line(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    """A multi-MB line around MAX_DOC_BYTES: a JSON document over it between ordinary lines,
    a line of junk (over or under it), a one-line text file over it, or a WARC header line."""
    size = rng.randint(MAX_DOC_BYTES + 1, 3 * MAX_DOC_BYTES)
    how = rng.choice(("jsonl_doc", "jsonl_junk", "txt", "warc"))
    if how == "jsonl_doc":  # over the limit only: under it, the cleaning chain would pay seconds
        text = (rng.choice(texts) + " ") * (size // min(map(len, texts)) + 1)
        lines = [jsonl(rng, texts[:1]), json.dumps({"text": text[:size]}).encode() + b"\n",
                 jsonl(rng, texts[-1:])]
        data = b"".join(lines[:rng.randint(2, 3)])
        suffix = rng.choice((".jsonl", ".jsonl.gz", ".jsonl.zst"))
        return FuzzFile(kind="huge_line", name=f"huge{suffix}", data=_compress(data, suffix),
                        records=count_jsonl_records(data))
    if how == "jsonl_junk":  # not JSON at all, no newline anywhere
        size = rng.choice((size, rng.randint(MAX_DOC_BYTES // 2, MAX_DOC_BYTES)))
        data = rng.randbytes(64).replace(b"\n", b" ") * (size // 64)
        return FuzzFile(kind="huge_line", name="junk.jsonl", data=data, records=count_jsonl_records(data))
    if how == "txt":
        suffix = rng.choice((".txt", ".txt.gz", ".txt.zst"))
        return FuzzFile(kind="huge_line", name=f"huge{suffix}",
                        data=_compress(b"word " * (size // 5 + 1), suffix), records=1)
    records = warc_records(rng, texts)
    i = rng.randrange(len(records))
    records[i] = records[i].replace(b"\r\n", b"\r\nX-Huge: " + b"h" * size + b"\r\n", 1)
    return FuzzFile(kind="huge_line", name="huge.warc", data=b"".join(records), records=len(records))


def broken_gzip(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    """Intact content, gzipped (WARC one member per record), then damaged."""
    how = rng.choice(("jsonl", "txt", "warc"))
    if how == "warc":
        data = b"".join(_gzip(r) for r in warc_records(rng, texts))
        name = rng.choice(("broken.warc.gz", "broken.wet.gz"))
    else:
        plain = jsonl(rng, texts) if how == "jsonl" else rng.choice(texts).encode()
        data = _gzip(plain) if rng.random() < 0.7 else _gzip(plain[:100]) + _gzip(plain[100:])
        name = rng.choice(("broken.jsonl.gz", "broken.json.gz")) if how == "jsonl" else "broken.txt.gz"
    return FuzzFile(kind="broken_gzip", name=name, data=_damage(rng, data), records=None)


def broken_zstd(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    """Intact content, zstd-compressed (one or two frames), then damaged."""
    plain = jsonl(rng, texts) if rng.random() < 0.7 else rng.choice(texts).encode()
    data = _zstd(plain) if rng.random() < 0.6 else _zstd(plain[:100]) + _zstd(plain[100:])
    name = rng.choice(("broken.jsonl.zst", "broken.jsonl.zstd", "broken.json.zst")) \
        if plain.startswith(b"{") else "broken.txt.zst"
    return FuzzFile(kind="broken_zstd", name=name, data=_damage(rng, data), records=None)


def broken_warc(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    """WARC records with damaged headers, truncated, or with garbage between them; a quarter
    are left intact (one event per record)."""
    records = warc_records(rng, texts)
    intact = rng.random() < 0.25
    if not intact:
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(records))
            records[i] = _break_header(rng, records[i])
        if rng.random() < 0.3:
            records.insert(rng.randrange(len(records) + 1), rng.randbytes(rng.randint(1, 300)))
    gzipped = rng.random() < 0.5
    data = b"".join(_gzip(r) if gzipped else r for r in records)
    if not intact and rng.random() < 0.3:
        data = data[:rng.randrange(1, len(data))]
    name = rng.choice(("broken.warc", "broken.wet")) + (".gz" if gzipped else "")
    return FuzzFile(kind="broken_warc", name=name, data=data, records=len(records) if intact else None)


def table_garbage(rng: random.Random, texts: Sequence[str]) -> FuzzFile:
    """Parquet or Arrow (stream or file) with odd columns (no or non-string `text`, nulls,
    invalid UTF-8, odd `metadata`/`url`), damaged half of the time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = rng.randint(1, 5)
    body = [rng.choice(texts) for _ in range(n)]
    how = rng.choice(("ok", "int_text", "null_text", "no_text", "binary_text", "bad_utf8",
                      "odd_metadata"))
    columns: dict[str, Any] = {"text": pa.array(body), "id": pa.array([f"r{i}" for i in range(n)])}
    if how == "int_text":
        columns["text"] = pa.array(range(n))
    elif how == "null_text":
        columns["text"] = pa.array([t if rng.random() < 0.5 else None for t in body])
    elif how == "no_text":
        columns["body"] = columns.pop("text")
    elif how == "binary_text":
        columns["text"] = pa.array([t.encode() for t in body], pa.binary())
    elif how == "bad_utf8":
        raw = pa.array([t.encode() + rng.choice((b"\xff", b"\xed\xa0\x80", b"")) for t in body],
                       pa.binary())
        columns["text"] = pa.Array.from_buffers(pa.string(), n, raw.buffers())  # not validated
    elif how == "odd_metadata":
        columns["metadata"] = pa.array([rng.choice(("x", "")) for _ in range(n)])
        columns["url"] = pa.array(range(n))
    else:
        columns["metadata"] = pa.array([{"url": f"https://fuzz.example.org/{i}"} for i in range(n)])
    table = pa.table(columns)
    buf = io.BytesIO()
    fmt = rng.choice(("parquet", "arrow_stream", "arrow_file"))
    if fmt == "parquet":
        pq.write_table(table, buf, row_group_size=rng.choice((1, 2, 1024)))
    else:
        writer = pa.ipc.new_stream if fmt == "arrow_stream" else pa.ipc.new_file
        with writer(buf, table.schema) as w:
            w.write_table(table, max_chunksize=rng.choice((1, 2, 1024)))
    data = buf.getvalue()
    damaged = rng.random() < 0.5
    name = "table.parquet" if fmt == "parquet" else "table.arrow"
    records = None if damaged else 0 if how == "no_text" else n
    return FuzzFile(kind="table_garbage", name=name, data=_damage(rng, data) if damaged else data,
                    records=records)


FAULTS: dict[str, Callable[[random.Random, Sequence[str]], FuzzFile]] = {
    "random_bytes": random_bytes, "empty": empty, "jsonl_lines": jsonl_lines,
    "encodings": encodings, "huge_line": huge_line, "broken_gzip": broken_gzip,
    "broken_zstd": broken_zstd, "broken_warc": broken_warc, "table_garbage": table_garbage,
}
