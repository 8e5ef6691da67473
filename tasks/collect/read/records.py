"""What a reader yields: `RawDoc` (a record that carries a document) or `Skipped` (one that does not,
with a snake_case reason the stage counts), and the quarantine helpers. Shared by every reader
module (readers, warc, tables, demo_crawl), which is why it sits apart from them.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO

SAMPLE_BYTES = 512  # bytes of offending input kept with a quarantined event
_SURROGATE = re.compile("[\ud800-\udfff]")

# Reasons that describe a whole file (or a damaged stretch of one) rather than one record; the
# stage does not count them as records read.
FILE_LEVEL_ERRORS = frozenset({
    "error_empty_file", "error_truncated_gzip", "error_corrupt_gzip", "error_truncated_zstd",
    "error_corrupt_zstd", "error_corrupt_warc", "error_not_warc", "error_corrupt_parquet",
    "error_corrupt_arrow", "error_no_text_column",
})


@dataclass(frozen=True, kw_only=True)
class RawDoc:
    """A record that carries a document, before text extraction."""

    url: str
    payload: bytes | str  # HTML as bytes (trafilatura sniffs the charset), text as bytes or str
    is_html: bool
    nbytes: int  # size of the raw record payload in bytes, for the funnel's bytes_in
    charset: str | None = None
    where: str = ""  # file and place in it, as in Skipped.where

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", valid_unicode(self.url))  # it is written out as UTF-8


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """A record (or file) that yields no document, and why."""

    reason: str
    nbytes: int = 0
    where: str = ""  # file and place in it: file@<byte offset> (WARC, JSON lines), file#<row>
    sample: bytes | None = None  # first SAMPLE_BYTES of the input, set where it is quarantined


@dataclass(frozen=True)
class Part:
    """The piece of an input file that one work unit reads: the records that *start* in
    [start, end), so the parts of a file together read each record once, as reading it whole
    does. Byte offsets for JSON lines and WARC/WET, row-group indices for Parquet; `end` None
    reads to the end of the file."""

    start: int = 0
    end: int | None = None


WHOLE = Part()
ReadEvent = RawDoc | Skipped
Reader = Callable[[IO[bytes], str, int, Part], Iterator[ReadEvent]]


def runs(sizes: Sequence[int], unit_bytes: int) -> list[tuple[int, int]]:
    """Consecutive index ranges [i, j) of `sizes` (records, row groups) that each reach
    `unit_bytes`, the last one taking what is left: where a file is cut into parts."""
    if not sizes:
        return []
    bounds, total = [0], 0
    for i, size in enumerate(sizes[:-1], start=1):
        total += size
        if total >= unit_bytes:
            bounds.append(i)
            total = 0
    return list(itertools.pairwise([*bounds, len(sizes)]))


def quarantine(reason: str, nbytes: int, where: str, data: bytes | str) -> Skipped:
    """A Skipped that keeps the start of the offending input for review."""
    head = data[:SAMPLE_BYTES]
    return Skipped(reason=reason, nbytes=nbytes, where=where, sample=head.encode("utf-8", "replace")
                   if isinstance(head, str) else bytes(head))


def quarantine_record(event: Skipped) -> dict[str, str | int]:
    """A JSON-ready line for a quarantine file; undecodable sample bytes become \\x escapes."""
    sample = (event.sample or b"").decode("utf-8", "backslashreplace")
    return {"reason": event.reason, "where": event.where, "nbytes": event.nbytes,
            "sample": sample}


def record_event(record: object, nbytes: int, where: str, raw: bytes | None = None) -> ReadEvent:
    """A parsed dolma-style record → RawDoc (`text`; URL from metadata.url, url, or a URL id)."""
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        return quarantine("error_missing_text", nbytes, where,
                          raw if raw is not None else repr(record))
    metadata = given if isinstance(given := record.get("metadata"), dict) else {}
    record_id = given_id if isinstance(given_id := record.get("id"), str) else ""
    url = next((u for u in (metadata.get("url"), record.get("url")) if isinstance(u, str) and u),
               record_id if "://" in record_id else "")
    return RawDoc(url=url, payload=record["text"], is_html=False, nbytes=nbytes, where=where)


def valid_unicode(text: str) -> str:
    """`text` with lone surrogates (valid JSON escapes such as "\\ud800", but not characters)
    replaced by U+FFFD: they cannot be written as UTF-8, so one would fail the unit's write."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace") \
        if _SURROGATE.search(text) else text
