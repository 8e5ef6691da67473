"""Input readers for the collect stage: WARC/WET via warcio and dolma-style JSONL.

A reader turns one input file into a stream of events: a `RawDoc` (a record that carries a
document: HTML bytes or plain text, with its URL) or a `Skipped` (a record that does not, or
input that could not be decoded, with a snake_case reason the stage counts). Readers never raise
on bad input: one corrupt record or line is counted and reading goes on where it can.
`extract_text` turns a `RawDoc` into clean text (trafilatura for HTML, ftfy for Unicode repair).
"""
from __future__ import annotations

import glob
import gzip
import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

WARC_SUFFIXES = (".warc", ".warc.gz", ".wet", ".wet.gz")  # Common Crawl WET: *.warc.wet.gz
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")
SUPPORTED_SUFFIXES = WARC_SUFFIXES + JSONL_SUFFIXES

# trafilatura logs an ERROR for every page it cannot parse; with millions of records that drowns
# the stage log, and such pages are counted anyway (skipped_no_text).
logging.getLogger("trafilatura").setLevel(logging.CRITICAL)

HTML_MIMES = frozenset({"text/html", "application/xhtml+xml"})
# Reasons that describe a whole file rather than one record (not counted as records read).
FILE_LEVEL_ERRORS = frozenset({
    "error_empty_file", "error_truncated_gzip", "error_corrupt_gzip", "error_corrupt_warc",
    "error_not_warc",
})


@dataclass(frozen=True)
class RawDoc:
    """A record that carries a document, before text extraction."""

    url: str
    payload: bytes | str  # HTML as bytes (trafilatura sniffs the charset), text as bytes or str
    is_html: bool
    nbytes: int  # size of the raw record payload in bytes, for the funnel's bytes_in
    charset: str | None = None


@dataclass(frozen=True)
class Skipped:
    """A record (or file) that yields no document, and why."""

    reason: str
    nbytes: int = 0


ReadEvent = RawDoc | Skipped


def is_supported(path: str | Path) -> bool:
    return str(path).lower().endswith(SUPPORTED_SUFFIXES)


def resolve_source(source: str) -> list[Path]:
    """The input files of a file/directory/glob source, sorted; ValueError naming it if none."""
    path = Path(source).expanduser()
    if path.is_file():
        if not is_supported(path):
            raise ValueError(f"source {source!r}: unsupported file type (expected one of "
                             f"{', '.join(SUPPORTED_SUFFIXES)})")
        return [path]
    if path.is_dir():
        candidates = [p for p in path.rglob("*") if p.is_file()]
    else:
        candidates = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    files = sorted(p for p in candidates if is_supported(p))
    if not files:
        raise ValueError(f"source {source!r} does not exist or matches no input files "
                         f"({', '.join(SUPPORTED_SUFFIXES)})")
    return files


def read_file(path: Path) -> Iterator[ReadEvent]:
    """Dispatch on the file suffix; an empty file is one counted error."""
    name = str(path).lower()
    if not name.endswith(SUPPORTED_SUFFIXES):
        raise ValueError(f"{path}: unsupported file type "
                         f"(expected one of {', '.join(SUPPORTED_SUFFIXES)})")
    if path.stat().st_size == 0:
        yield Skipped("error_empty_file")
        return
    yield from (read_warc if name.endswith(WARC_SUFFIXES) else read_jsonl)(path)


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


def _warc_event(record) -> ReadEvent:
    """One WARC record → a RawDoc for response/conversion records with text, else a Skipped."""
    size = int(record.length or 0)
    if record.rec_type not in ("response", "conversion"):
        return Skipped(f"skipped_record_{record.rec_type}", size)
    headers = record.http_headers  # None for conversion (WET) and non-HTTP (dns:) responses
    if headers is not None:
        status = int(headers.get_statuscode() or 0)
        if not 200 <= status < 300:
            return Skipped(f"skipped_http_{status // 100}xx", size)
    content_type = (headers or record.rec_headers).get_header("Content-Type") or ""
    kind = classify_mime(content_type)
    if kind.startswith("skipped_"):
        return Skipped(kind, size)
    try:  # content_stream() undoes chunking and gzip/br content encodings, which can be broken
        payload = record.content_stream().read()
    except (OSError, EOFError, ValueError, zlib.error):
        return Skipped("error_bad_payload", size)
    if getattr(record.raw_stream, "limit", 0) > 0:  # fewer bytes than Content-Length: cut off
        return Skipped("error_truncated_record", size)
    url = record.rec_headers.get_header("WARC-Target-URI") or ""
    return RawDoc(url, payload, kind == "html", size, _charset(content_type))


def read_warc(path: Path) -> Iterator[ReadEvent]:
    """Records of a WARC/WET file (plain or gzip per record); stops at unrecoverable damage."""
    from warcio.archiveiterator import ArchiveIterator
    from warcio.exceptions import ArchiveLoadFailed

    with open(path, "rb") as f:
        try:
            for record in ArchiveIterator(f):
                if not record.format.startswith("warc"):  # warcio falls back to ARC on garbage
                    yield Skipped("error_not_warc")
                    return
                yield _warc_event(record)
        except (ArchiveLoadFailed, EOFError, zlib.error, OSError, ValueError):
            yield Skipped("error_corrupt_warc")


def _jsonl_event(line: bytes) -> ReadEvent:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return Skipped("error_invalid_utf8", len(line))
    except json.JSONDecodeError:
        return Skipped("error_bad_json", len(line))
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        return Skipped("error_missing_text", len(line))
    metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    record_id = str(record.get("id") or "")
    url = metadata.get("url") or record.get("url") or (record_id if "://" in record_id else "")
    return RawDoc(str(url), record["text"], False, len(line))


def read_jsonl(path: Path) -> Iterator[ReadEvent]:
    """dolma-style JSON lines (`text`, `id`, `metadata.url`), plain or gzipped."""
    opener = gzip.open if str(path).lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for line in f:
                if line.strip():
                    yield _jsonl_event(line)
    except EOFError:  # gzip stream ended early: everything before it was read
        yield Skipped("error_truncated_gzip")
    except (gzip.BadGzipFile, zlib.error):
        yield Skipped("error_corrupt_gzip")


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
