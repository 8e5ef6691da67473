"""Input readers for the collect stage: WARC/WET, JSON lines, Parquet, Arrow and plain text, from
any fsspec path (local, file://, memory://, s3:// with s3fs installed, ...).

A reader turns one input file into a stream of events: a `RawDoc` (a record that carries a
document: HTML bytes or plain text, with its URL) or a `Skipped` (a record that does not, or
input that could not be decoded, with a snake_case reason the stage counts). Readers never raise
on bad input: one corrupt record or line is counted and reading goes on where it can.
`extract_text` turns a `RawDoc` into clean text (trafilatura for HTML, ftfy for Unicode repair).

Formats, by file suffix:
  .warc .warc.gz .wet .wet.gz          WARC/WET records (warc.py)
  .jsonl .json.gz .jsonl.gz .jsonl.zst dolma-style JSON lines: `text`, `id`, `metadata.url`/`url`
  .parquet .arrow                      one document per row, same columns (tables.py);
                                       a `datasets` save_to_disk folder is read as its .arrow files
  .txt .txt.gz .txt.zst                one document per file (a folder of them is a corpus)

Every document passes two guards in `read_file`: larger than `max_doc_bytes` → skipped_too_large;
binary content → skipped_binary. Quarantine: a `Skipped` that carries a `sample` (errors and
binary payloads) is input worth a look; `where` names the file and the place in it
(`file@<byte offset>` of the record or line for WARC and JSON lines: in the decompressed stream of
a .jsonl.gz/.zst; `file#<row>` for tables).

Large files are read in parts (`split_file`; a `Part` is the records that start in a byte range
or the row groups in a range), one work unit each: plain JSON lines in line-aligned byte ranges,
WARC/WET in runs of whole records, Parquet in runs of row groups. Reading the whole file is
reading its one part, so the parts together yield the same events, in the same order. A
compressed single stream (.jsonl.gz/.zst, .txt.gz) cannot be entered in the middle, and Arrow and
text files are small or one document: they stay one part.
"""
from __future__ import annotations

import codecs
import gzip
import io
import itertools
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, cast

from gristmill.core.files import open_location
from gristmill.core.sources import file_size, source_files
from gristmill.tasks.collect.read.records import (
    FILE_LEVEL_ERRORS,
    SAMPLE_BYTES,
    WHOLE,
    Part,
    RawDoc,
    Reader,
    ReadEvent,
    Skipped,
    quarantine,
    quarantine_record,
    record_event,
)
from gristmill.tasks.collect.read.tables import parquet_parts, read_arrow, read_parquet
from gristmill.tasks.collect.read.warc import read_warc, warc_parts

# The reader API: the record types (records.py) are re-exported, readers' users need both.
__all__ = [
    "FILE_LEVEL_ERRORS",
    "SUPPORTED_SUFFIXES",
    "TEXT_SUFFIXES",
    "WHOLE",
    "Part",
    "RawDoc",
    "ReadEvent",
    "Skipped",
    "decode_text",
    "extract_text",
    "is_binary",
    "quarantine_record",
    "read_file",
    "resolve_source",
    "split_file",
]

WARC_SUFFIXES = (".warc", ".warc.gz", ".wet", ".wet.gz")  # Common Crawl WET: *.warc.wet.gz
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".jsonl.zstd", ".json.zst")
TABLE_SUFFIXES = (".parquet", ".arrow")
TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst")
SUPPORTED_SUFFIXES = WARC_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES + TEXT_SUFFIXES

DEFAULT_MAX_DOC_BYTES = 10_000_000  # 10 MB: far above any real page, below a memory problem
BINARY_SNIFF_BYTES = 8192  # binary detection looks at the start of a payload only
# Share of C0 control bytes above which a payload is binary. Text in any charset has ~none
# (8-bit and CJK encodings avoid C0; ISO-2022's ESC is allowed); compressed data has ~11%.
MAX_CONTROL_FRAC = 0.05
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\v\f\r\x1b") + b"\x7f"

# trafilatura logs an ERROR for every page it cannot parse; with millions of records that drowns
# the stage log, and such pages are counted anyway (skipped_no_text).
logging.getLogger("trafilatura").setLevel(logging.CRITICAL)
log = logging.getLogger(__name__)

def is_supported(path: str | Path) -> bool:
    return str(path).lower().endswith(SUPPORTED_SUFFIXES)


def resolve_source(source: str) -> list[Path | str]:
    """The input files of a file, directory or glob source (any fsspec URL) that a reader here
    can read, sorted (core.sources.source_files with this module's suffixes)."""
    return source_files(source, SUPPORTED_SUFFIXES)


def _reader_for(name: str) -> Reader:
    lowered = name.lower()
    if lowered.endswith(WARC_SUFFIXES):
        return read_warc
    if lowered.endswith(JSONL_SUFFIXES):
        return read_jsonl
    if lowered.endswith(".parquet"):
        return read_parquet
    if lowered.endswith(".arrow"):
        return read_arrow
    if lowered.endswith(TEXT_SUFFIXES):
        return read_text
    raise ValueError(f"{name}: unsupported file type "
                     f"(expected one of {', '.join(SUPPORTED_SUFFIXES)})")


def read_file(path: str | Path, *, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
              part: Part = WHOLE, planned_size: int | None = None) -> Iterator[ReadEvent]:
    """Events of one input file (a local path or fsspec URL), or of one part of it from
    `split_file`. One error, and nothing read, for an empty file, and for a file gone
    (error_input_missing; also when it goes while it is read, after what was read of it: an object
    store's client lists from a cache) or of another size (error_input_changed) than `planned_size`, its size
    when the run listed it: the run's key was computed from what it held then, and parts cut from
    another size no longer start at records. Each part of such a file is one error; the part that
    starts the file counts its planned bytes."""
    name = str(path)
    reader = _reader_for(name)
    planned_bytes = (planned_size or 0) if part.start == 0 else 0
    try:
        size = file_size(name)
        if planned_size is not None and size != planned_size:
            log.warning("%s: %d bytes now, %d when the run listed it; not read", name, size, planned_size)
            yield Skipped(reason="error_input_changed", nbytes=planned_bytes, where=name)
            return
        if size == 0:
            yield Skipped(reason="error_empty_file", nbytes=0, where=name)
            return
        f = open_location(name)
    except FileNotFoundError:
        log.warning("%s: gone since the run listed it; not read", name)
        yield Skipped(reason="error_input_missing", nbytes=planned_bytes, where=name)
        return
    read_any = False
    with f:
        try:
            for event in reader(f, name, max_doc_bytes, part):
                read_any = True
                yield guard(event, max_doc_bytes) if isinstance(event, RawDoc) else event
        except FileNotFoundError:  # an object store's cached listing outlived the object: gone on reading
            log.warning("%s: gone while it was read; the rest of it not read", name)
            yield Skipped(reason="error_input_missing", nbytes=0 if read_any else planned_bytes, where=name)


def split_file(path: str | Path, unit_bytes: int) -> list[Part]:
    """The parts of an input file that work units read separately, each about `unit_bytes` on
    disk; a file no larger, or one that cannot be entered in the middle, is one part."""
    name = str(path)
    try:
        size = file_size(path)
    except FileNotFoundError:  # gone since it was listed: its one unit says so (read_file)
        return [WHOLE]
    lowered = name.lower()
    if size <= unit_bytes:
        return [WHOLE]
    if lowered.endswith(".jsonl"):  # the one JSON-lines suffix that is not compressed
        n_parts = -(-size // unit_bytes)
        bounds = [size * i // n_parts for i in range(n_parts + 1)]
        return [Part(a, b) for a, b in itertools.pairwise(bounds)]
    splitter = warc_parts if lowered.endswith(WARC_SUFFIXES) else \
        parquet_parts if lowered.endswith(".parquet") else None
    if splitter is None:
        return [WHOLE]
    with open_location(name) as f:
        return splitter(f, unit_bytes)


def is_binary(payload: bytes | str) -> bool:
    """NUL bytes, or more than MAX_CONTROL_FRAC other control bytes, in the first 8 KiB."""
    head = payload[:BINARY_SNIFF_BYTES]
    if isinstance(head, str):
        head = head.encode("utf-8", "surrogatepass")
    if b"\x00" in head:
        return True
    n_control = len(head) - len(head.translate(None, _CONTROL_BYTES))
    return n_control > MAX_CONTROL_FRAC * len(head)


def guard(doc: RawDoc, max_doc_bytes: int) -> ReadEvent:
    """The document, or why it is not one: too large (in bytes or characters), or binary."""
    if len(doc.payload) > max_doc_bytes:
        return Skipped(reason="skipped_too_large", nbytes=doc.nbytes, where=doc.where)
    if is_binary(doc.payload):
        return quarantine("skipped_binary", doc.nbytes, doc.where, doc.payload)
    return doc


# --- compressed streams ----------------------------------------------------------------------

class CorruptStream(OSError):
    """Compressed data that cannot be decoded (not a truncation)."""


# Compressed bytes per decompress call. The call returns everything they expand to, and a zstd
# block of 4 bytes can stand for 128 KiB (a ratio of 32768), so 1 KiB bounds one call's output at
# 32 MiB: a 12 KB "bomb" fed 1 MiB at a time expanded to 400 MB at once.
ZSTD_FEED_BYTES = 1024


class _ZstdStream(io.RawIOBase):
    """Concatenated zstd frames, decompressed. zstandard's stream_reader ends silently on a
    truncated frame; this raises EOFError there, as gzip does."""

    def __init__(self, raw: IO[bytes], chunk_bytes: int = 1 << 20) -> None:
        import zstandard

        self._raw, self._chunk_bytes, self._error = raw, chunk_bytes, zstandard.ZstdError
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._out, self._pos = b"", 0
        self._input, self._at = memoryview(b""), 0  # compressed bytes read, not yet fed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos >= len(self._out):
            if self._at >= len(self._input):
                self._input, self._at = memoryview(self._raw.read(self._chunk_bytes)), 0
                if not self._input:
                    if self._in_frame:
                        raise EOFError("zstd stream ends inside a frame")
                    return 0
            piece = self._input[self._at:self._at + ZSTD_FEED_BYTES]
            self._at += len(piece)
            self._out, self._pos = self._decompress(piece), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def _decompress(self, data: bytes | memoryview) -> bytes:
        pieces = []
        try:
            while data:
                pieces.append(self._obj.decompress(data))
                self._in_frame = not self._obj.eof
                data = self._obj.unused_data if self._obj.eof else b""
                if self._obj.eof:
                    self._obj = self._dctx.decompressobj()
        except self._error as exc:
            raise CorruptStream(str(exc)) from None
        return b"".join(pieces)


def _codec(name: str) -> str | None:
    lowered = name.lower()
    if lowered.endswith(".gz"):
        return "gzip"
    return "zstd" if lowered.endswith((".zst", ".zstd")) else None


def open_decompressed(f: IO[bytes], name: str) -> IO[bytes]:
    """A buffered binary stream of the file's content, decompressed by its suffix."""
    codec = _codec(name)
    if codec == "gzip":  # GzipFile has IO[bytes]'s methods, though typeshed derives it from BufferedIOBase only
        return cast(IO[bytes], gzip.GzipFile(fileobj=f, mode="rb"))
    # a file opened binary has the readinto a BufferedReader reads through (IO[bytes] declares none)
    return io.BufferedReader(_ZstdStream(f) if codec == "zstd" else cast(io.RawIOBase, f), 1 << 20)


def _file_tail(name: str) -> bytes:
    """The last SAMPLE_BYTES of a file: where a truncated or damaged stream is worth a look."""
    with open_location(name) as f:
        f.seek(max(0, file_size(name) - SAMPLE_BYTES))
        return f.read()


def _stream_events(events: Iterator[ReadEvent], name: str) -> Iterator[ReadEvent]:
    """Pass events on; a damaged compressed stream ends them with one counted error, quarantined
    with the file's last bytes as its sample."""
    codec = _codec(name) or "stream"
    try:
        yield from events
    except EOFError:  # the stream ended early: everything before it was read
        yield quarantine(f"error_truncated_{codec}", 0, name, _file_tail(name))
    except (gzip.BadGzipFile, zlib.error, CorruptStream):
        yield quarantine(f"error_corrupt_{codec}", 0, name, _file_tail(name))


# --- JSON lines and plain text ----------------------------------------------------------------

def _jsonl_event(line: bytes, where: str) -> ReadEvent:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return quarantine("error_invalid_utf8", len(line), where, line)
    try:
        record = json.loads(text)
    # ValueError: json's own, and an integer of over 4300 digits; RecursionError: nesting
    # deeper than the interpreter's stack ("[[[[..." a few thousand deep)
    except (ValueError, RecursionError):
        return quarantine("error_bad_json", len(line), where, line)
    return record_event(record, len(line), where, line)


def _rest_of_line(stream: IO[bytes], line: bytes) -> int:
    """Bytes of the rest of a line that began with `line`, read in 1 MiB pieces, not held."""
    nbytes = len(line)
    while not line.endswith(b"\n") and (line := stream.readline(1 << 20)):
        nbytes += len(line)
    return nbytes


def _lines(stream: IO[bytes], max_line_bytes: int,
           part: Part) -> Iterator[tuple[int, bytes | None, int]]:
    """(offset, line, its size in bytes) of the lines that start in `part`; the line is None when
    it is longer than max_line_bytes, and is then skipped instead of held in memory. A line that
    starts before the part belongs to the part before; the last line may end after the part."""
    offset = part.start
    if offset > 0:  # the line ending at offset - 1, if any, is the previous part's
        stream.seek(offset - 1)
        offset += _rest_of_line(stream, stream.readline(1)) - 1
    while (part.end is None or offset < part.end) and (line := stream.readline(max_line_bytes + 1)):
        nbytes = len(line) if len(line) <= max_line_bytes else _rest_of_line(stream, line)
        yield offset, line if nbytes <= max_line_bytes else None, nbytes
        offset += nbytes


def read_jsonl(f: IO[bytes], name: str, max_doc_bytes: int,
               part: Part = WHOLE) -> Iterator[ReadEvent]:
    """dolma-style JSON lines, plain, gzip or zstd; a line over max_doc_bytes is skipped. A part
    (of a plain file only: a compressed stream is not seekable) reads the lines starting in it."""
    def events() -> Iterator[ReadEvent]:
        for offset, line, nbytes in _lines(open_decompressed(f, name), max_doc_bytes, part):
            where = f"{name}@{offset}"
            if line is None:
                yield Skipped(reason="skipped_too_large", nbytes=nbytes, where=where)
                continue
            if offset == 0:  # a UTF-8 byte order mark (Windows tools write one) is not JSON
                line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield _jsonl_event(line, where)

    yield from _stream_events(events(), name)


def read_text(f: IO[bytes], name: str, max_doc_bytes: int,
              part: Part = WHOLE) -> Iterator[ReadEvent]:
    """A whole plain-text file as one document (its URL is the file's path or URL); never split
    (one part)."""
    def events() -> Iterator[ReadEvent]:
        stream = open_decompressed(f, name)
        data = stream.read(max_doc_bytes + 1)
        if len(data) <= max_doc_bytes:
            yield RawDoc(url=name, payload=data, is_html=False, nbytes=len(data), where=name)
            return
        nbytes = len(data)
        while piece := stream.read(1 << 20):  # count it for bytes_in without holding it
            nbytes += len(piece)
        yield Skipped(reason="skipped_too_large", nbytes=nbytes, where=name)

    yield from _stream_events(events(), name)


# --- text extraction --------------------------------------------------------------------------

def decode_text(payload: bytes | str, charset: str | None) -> str:
    """Bytes → str: the declared charset, then UTF-8, then cp1252 (which ftfy can repair)."""
    if isinstance(payload, str):
        return payload
    for encoding in (charset, "utf-8"):
        if encoding:
            try:
                return payload.decode(encoding)
            except (LookupError, UnicodeDecodeError):
                pass
    return payload.decode("cp1252", errors="replace")


def extract_text(doc: RawDoc) -> str | None:
    """Main text of a record, Unicode-repaired; None when nothing is left."""
    import ftfy
    import trafilatura

    if doc.is_html:
        # Precision over recall: boilerplate (menus, cookie banners) hurts a small model more
        # than a lost paragraph; tables come out as pipe soup, so leave them out too.
        text = trafilatura.extract(doc.payload, url=doc.url or None, favor_precision=True,
                                   include_comments=False, include_tables=False)
    else:
        text = decode_text(doc.payload, doc.charset)
    text = ftfy.fix_text(text or "").strip()
    return text or None
