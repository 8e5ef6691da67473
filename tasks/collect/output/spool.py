"""The kept documents on disk while the collect stage's corpus-level steps run, so the stage's
memory does not grow with the corpus.

Each work unit writes its kept documents' output lines (`json.dumps(doc) + "\\n"`, byte for byte
what a docs shard holds) to a spool file of its own beside its events (`SpoolWriter`), and each
kept event says where its line is. Merging the events, the stage keeps a few numbers per
document in columns (`DocTable`, 48 bytes a document): its 128-bit text hash (the first 64 bits
are its id), its source, which spool file and where in it its line is, and its text's size.
The steps select rows of the table and read texts back in passes: `DocTable.texts()` is a lazy
sequence (read/texts.py's `Texts`) that an engine worker reads its own chunk of the corpus
through (from the bucket, when the store is one). The shards are written by copying lines, on
the engine.
"""
from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from gristmill.tasks.collect.read.texts import Texts

Doc = dict[str, Any]  # {"id", "text", "source", "url", "language"}


def text_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


COLUMNS = ("hash_hi", "hash_lo", "source", "file", "offset", "size", "text_bytes")
_DTYPES = {"hash_hi": np.uint64, "hash_lo": np.uint64, "source": np.int32, "file": np.int32,
           "offset": np.int64, "size": np.int64, "text_bytes": np.int64}


@dataclass(frozen=True, kw_only=True)
class DocTable:
    """Spooled documents, a numpy column each; rows are selected with `take`."""

    sources: tuple[str, ...]  # the source names `source` indexes
    paths: tuple[str, ...]  # the spool files `file` indexes (paths or URLs)
    hash_hi: np.ndarray  # uint64: the first 64 bits of the text hash; the id is them in hex
    hash_lo: np.ndarray  # uint64: the next 64
    source: np.ndarray  # int32
    file: np.ndarray  # int32
    offset: np.ndarray  # int64: of the output line in its spool file
    size: np.ndarray  # int64: bytes of that line
    text_bytes: np.ndarray  # int64: of the text, UTF-8

    def __len__(self) -> int:
        return len(self.hash_hi)

    def take(self, rows: np.ndarray) -> DocTable:
        """The rows at positions (or where a mask is True), in that order."""
        return DocTable(sources=self.sources, paths=self.paths,
                        **{name: getattr(self, name)[rows] for name in COLUMNS})

    def id(self, row: int) -> str:
        return f"{int(self.hash_hi[row]):016x}"

    @property
    def ids(self) -> Sequence[str]:
        """The documents' ids, made when asked for (nothing held per document)."""
        return _Ids(self.hash_hi)

    def texts(self) -> Texts:
        """The texts, lazily, where engine workers can read them."""
        return Texts(self.paths, self.file, self.offset, self.size)

    def doc(self, row: int) -> Doc:
        """One document, whole: for a review sample of a drop."""
        return json.loads(next(self.texts().take([row]).lines()))


class _Ids(Sequence[str]):
    def __init__(self, hash_hi: np.ndarray):
        self.hash_hi = hash_hi

    def __len__(self) -> int:
        return len(self.hash_hi)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [f"{h:016x}" for h in self.hash_hi[i].tolist()]
        return f"{int(self.hash_hi[i]):016x}"


class TableBuilder:
    """A DocTable's rows appended one at a time (as the units' events are merged)."""

    def __init__(self) -> None:
        self._sources: dict[str, int] = {}
        self._columns = {name: array("Q" if _DTYPES[name] == np.uint64 else "q") for name in COLUMNS}

    def add(self, source: str, digest: bytes, file: int, offset: int, size: int, nbytes: int) -> None:
        """One document: `digest` its 16-byte (or longer) text hash, its line at `offset` (`size`
        bytes) of spool file `file`, `nbytes` its text's UTF-8 bytes."""
        values = (int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:16], "big"),
                  self._sources.setdefault(source, len(self._sources)), file, offset, size, nbytes)
        for column, value in zip(self._columns.values(), values):
            column.append(value)

    def table(self, paths: Sequence[str]) -> DocTable:
        columns = {name: np.frombuffer(values, np.uint64 if values.typecode == "Q" else np.int64)
                   .astype(_DTYPES[name], copy=False) for name, values in self._columns.items()}
        self._columns = {}
        return DocTable(sources=tuple(self._sources), paths=tuple(paths), **columns)


class SpoolWriter:
    """A work unit's kept documents appended to its spool file (a local file, opened by the
    caller); `add` says where each line went."""

    def __init__(self, out: BinaryIO):
        self._out, self._end = out, 0

    def add(self, doc: Doc) -> tuple[int, int]:
        """Write one document's output line; returns its (offset, size)."""
        line = (json.dumps(doc, ensure_ascii=False) + "\n").encode()
        self._out.write(line)
        self._end += len(line)
        return self._end - len(line), len(line)
