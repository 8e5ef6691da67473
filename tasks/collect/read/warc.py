"""WARC/WET reader for the collect stage (warcio), plain or gzip per record.

Response and conversion (WET) records with an HTML or plain-text payload become `RawDoc`s; every
other record is a `Skipped` counted by type: `skipped_record_<WARC-Type>` (request, metadata,
revisit, warcinfo, resource...; `_unknown` for a type WARC 1.1 does not define, `_missing`),
`skipped_http_<N>xx` (`skipped_http_bad_status` when the status is not three digits),
`skipped_mime_<kind>` (image, css, javascript...), `skipped_empty_payload`, `skipped_too_large`.
A damaged stretch (corrupt gzip member, garbled record header) is counted once as
`error_corrupt_warc`, and reading resumes at the next record boundary found after it: the next
gzip member header, or the next line starting `WARC/1.` in an uncompressed file.

A large file is read in parts (`warc_parts`): runs of whole records, cut at the offsets of record
starts (gzip members of a .warc.gz) found by one pass over the file's record framing.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import IO

from gristmill.tasks.collect.read.records import (
    SAMPLE_BYTES,
    WHOLE,
    Part,
    RawDoc,
    ReadEvent,
    Skipped,
    quarantine,
    runs,
)

HTML_MIMES = frozenset({"text/html", "application/xhtml+xml"})
WARC_TYPES = frozenset({"warcinfo", "response", "resource", "request", "metadata", "revisit",
                        "conversion", "continuation"})  # WARC 1.1, 6.3
GZIP_MEMBER = b"\x1f\x8b\x08"  # gzip magic + deflate method: where a per-record member starts
WARC_LINE = b"\nWARC/1."  # a record's first line, after the previous record's line end
SCAN_CHUNK_BYTES = 1 << 20


def classify_mime(content_type: str) -> str:
    """'html', 'text', or the skip reason for a MIME type we do not extract text from."""
    mime = content_type.split(";")[0].strip().lower()
    if mime in HTML_MIMES:
        return "html"
    if mime == "text/plain":
        return "text"
    if not mime:
        return "skipped_mime_missing"
    major, _, minor = mime.partition("/")
    if major in ("image", "audio", "video", "font"):
        return f"skipped_mime_{major}"
    for kind in ("css", "javascript", "json", "xml", "pdf", "dns"):
        if kind in minor:
            return f"skipped_mime_{kind}"
    return "skipped_mime_other"


def _charset(content_type: str) -> str | None:
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key.lower() == "charset" and value:
            return value.strip("\"' ").lower()
    return None


def _skip_reason(record) -> str | None:
    """Why a record carries no document, judged from its headers alone."""
    if record.rec_type not in ("response", "conversion"):
        # reasons become counter (and MLflow metric) names: none made of a header's raw value
        kind = record.rec_type if record.rec_type in WARC_TYPES else \
            "unknown" if record.rec_type else "missing"
        return f"skipped_record_{kind}"
    headers = record.http_headers  # None for conversion (WET) and non-HTTP (dns:) responses
    if headers is not None:
        code = headers.get_statuscode() or ""
        status = int(code) if len(code) == 3 and code.isascii() and code.isdigit() else 0
        if not 200 <= status < 300:
            return f"skipped_http_{status // 100}xx" if status else "skipped_http_bad_status"
    kind = classify_mime((headers or record.rec_headers).get_header("Content-Type") or "")
    return kind if kind.startswith("skipped_") else None


def warc_event(record, where: str, max_doc_bytes: int) -> ReadEvent:
    """One WARC record → a RawDoc for response/conversion records with text, else a Skipped."""
    size = int(record.length or 0)
    reason = _skip_reason(record)
    if reason is not None:
        return Skipped(reason=reason, nbytes=size, where=where)
    if size > max_doc_bytes:  # judged before reading: the payload never enters memory
        return Skipped(reason="skipped_too_large", nbytes=size, where=where)
    try:  # content_stream() undoes chunking and gzip/br content encodings, which can be broken
        payload = record.content_stream().read(max_doc_bytes + 1)  # +1: a bomb shows as too large
    except Exception:  # zlib, brotli, chunking: each decoder has its own errors
        return quarantine("error_bad_payload", size, where, record.rec_headers.to_str())
    if getattr(record.raw_stream, "limit", 0) > 0:  # fewer bytes than Content-Length: cut off
        return quarantine("error_truncated_record", size, where, payload)
    if not payload.strip():
        return Skipped(reason="skipped_empty_payload", nbytes=size, where=where)
    headers = record.http_headers or record.rec_headers
    content_type = headers.get_header("Content-Type") or ""
    url = record.rec_headers.get_header("WARC-Target-URI") or ""
    return RawDoc(url=url, payload=payload, is_html=classify_mime(content_type) == "html", nbytes=size,
                  charset=_charset(content_type), where=where)


def _find(f: IO[bytes], marker: bytes, start: int) -> int | None:
    """Offset of the first `marker` at or after `start`, scanning in 1 MiB chunks."""
    f.seek(start)
    carry, pos = b"", start  # carry: the tail of the previous chunk, for a marker cut in two
    while chunk := f.read(SCAN_CHUNK_BYTES):
        found = (carry + chunk).find(marker)
        if found >= 0:
            return pos - len(carry) + found
        carry = (carry + chunk)[-(len(marker) - 1):]
        pos += len(chunk)
    return None


def _peek(f: IO[bytes], offset: int) -> bytes:
    f.seek(offset)
    return f.read(SAMPLE_BYTES)


class _NotWarc(Exception):
    """warcio parsed a record as ARC: what it does with bytes that are not a WARC record."""


def _records(f: IO[bytes], name: str, max_doc_bytes: int, state: dict,
             end: int | None) -> Iterator[ReadEvent]:
    """Events from the current position until the end (of the file, or the first record starting
    at `end` or later) or the first damage, which raises; state["records"].offset is the start of
    the record being read (or parsed) in the file, state["last"] that of the last record whose
    event was yielded."""
    from warcio.archiveiterator import ArchiveIterator

    records = state["records"] = ArchiveIterator(f)
    for record in records:
        if end is not None and records.offset >= end:  # the next part's first record
            return
        if not record.format.startswith("warc"):
            raise _NotWarc(record.format)
        event = warc_event(record, f"{name}@{records.offset}", max_doc_bytes)
        state["last"] = records.offset
        yield event


def read_warc(f: IO[bytes], name: str, max_doc_bytes: int,
              part: Part = WHOLE) -> Iterator[ReadEvent]:
    """Records of a WARC/WET file (those starting in `part`, whose start is a record's offset
    from `warc_parts`), resynchronizing after each damaged stretch."""
    gzipped = f.read(2) == GZIP_MEMBER[:2]
    f.seek(0, 2)
    size = f.tell()
    marker, skip = (GZIP_MEMBER, 0) if gzipped else (WARC_LINE, 1)
    start: int | None = part.start
    while start is not None and (part.end is None or start < part.end):
        f.seek(start)
        state: dict = {}
        try:
            yield from _records(f, name, max_doc_bytes, state, part.end)
            return
        except _NotWarc:
            if start == 0:  # the file does not start as a WARC: not one at all
                yield quarantine("error_not_warc", 0, name, _peek(f, 0))
                return
        # warcio's parser fails on damaged headers with whatever the line it was on raised
        # (ArchiveLoadFailed, ValueError, also AttributeError for a response record without a
        # WARC-Target-URI): every one is a damaged stretch, counted and stepped over
        except Exception:
            pass
        bad = state["records"].offset if "records" in state else start
        # warcio's offset follows the lengths damaged headers declare: it can point back before
        # records already read (resuming there would count them again, or loop for ever) or
        # far past the end of the file
        bad = min(max(bad, state["last"] + 1 if "last" in state else start), size)
        yield quarantine("error_corrupt_warc", 0, f"{name}@{bad}", _peek(f, bad))
        found = _find(f, marker, bad + 1)
        start = None if found is None else found + skip


def warc_parts(f: IO[bytes], unit_bytes: int) -> list[Part]:
    """Runs of whole records of about `unit_bytes` each, cut at record offsets found by reading
    the record framing once (warcio decompresses the payloads, nothing parses them). A file that
    is not a clean WARC (damage, a length that does not match, several records in one gzip
    stream) is one part: its damaged stretches are read as reading it whole reads them."""
    from warcio.archiveiterator import ArchiveIterator

    offsets = []
    try:
        records = ArchiveIterator(f)
        for record in records:
            if not record.format.startswith("warc"):
                return [WHOLE]
            offsets.append(records.offset)
    except Exception:  # whatever warcio raises on damage (see read_warc)
        return [WHOLE]
    if records.err_count:  # a record whose Content-Length did not end at a record boundary
        return [WHOLE]
    f.seek(0, 2)
    sizes = [b - a for a, b in itertools.pairwise([*offsets, f.tell()])]
    cuts = runs(sizes, unit_bytes)
    if len(cuts) < 2:
        return [WHOLE]
    return [Part(offsets[i], offsets[j] if j < len(offsets) else None) for i, j in cuts]
