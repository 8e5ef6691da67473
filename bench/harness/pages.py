"""The extracted pages of a data folder's WARC files and JSONL documents, as (text, url): what the
cleaning chain's comparisons with datatrove read, in tests/tasks/collect/test_cleaning.py and `python -m bench
clean` alike (both on ../shared/data)."""
from __future__ import annotations

from pathlib import Path

from gristmill.tasks.collect.read.readers import RawDoc, extract_text, read_file, resolve_source

Page = tuple[str, str]  # (text, url)


def shared_pages(root: Path) -> list[Page]:
    """Extracted (text, url) of every WARC page and JSONL document under root/{warc,jsonl}."""
    pages: list[Page] = []
    for source in (root / "warc", root / "jsonl"):
        for path in resolve_source(str(source)):
            for record in read_file(path):
                if isinstance(record, RawDoc) and (text := extract_text(record)):
                    pages.append((text, record.url))
    return pages
