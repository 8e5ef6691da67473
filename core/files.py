"""Small file helpers shared by the stages: content digests and JSON-lines reading, for local
paths and any fsspec URL."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable


def file_digest(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """sha256 of a file's content, read in chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def iter_jsonl(paths: Iterable[Path | str]) -> Iterable[dict[str, Any]]:
    """Yield records from JSON-lines files (gzip/zstd by suffix), local or fsspec URLs."""
    import fsspec

    for path in paths:
        with fsspec.open(str(path), "rt", encoding="utf-8", compression="infer") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
