"""The kept documents on disk while the collect stage's corpus-level steps run, so the stage's
memory does not grow with the corpus.

`merge` appends each kept document's output line (`json.dumps(doc) + "\\n"`, byte for byte what a
docs shard holds) to one uncompressed file, and the spool keeps a few numbers per document in
columns (`DocTable`, ~44 bytes a document): its 128-bit text hash (the first 64 bits are its id),
its source, where its line is and its text's size. The steps select rows of the table and read
texts back in passes: `Spool.texts(table)` is a lazy sequence (`Texts`) that reads a text when it
is asked for, slices and `take`s into further lazy views, and pickles as a path and two arrays,
so an engine worker reads its own chunk of the corpus. The shards are written by copying lines.
"""
from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.files import open_location, publish_file
from tasks.collect.funnel import COLUMNS, Doc, DocTable, text_bytes

_BLOCK = 65_536  # documents whose positions are turned into Python numbers at once


class Texts(Sequence[str]):
    """The texts of spooled documents, read on demand (see the module docstring)."""

    def __init__(self, path: str, offsets: np.ndarray, sizes: np.ndarray):
        self.path, self.offsets, self.sizes = path, offsets, sizes

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        return next(iter(self.take([i])))

    def take(self, positions: Sequence[int] | np.ndarray) -> Texts:
        """The texts at `positions`, in that order, as another lazy view."""
        positions = np.asarray(positions, dtype=np.int64)
        return Texts(self.path, self.offsets[positions], self.sizes[positions])

    def __iter__(self) -> Iterator[str]:
        with open_location(self.path) as f:
            for lo in range(0, len(self), _BLOCK):  # no list of every document's numbers at once
                for offset, size in zip(self.offsets[lo:lo + _BLOCK].tolist(),
                                        self.sizes[lo:lo + _BLOCK].tolist()):
                    f.seek(offset)
                    yield json.loads(f.read(size))["text"]


def take(texts: Sequence[str], positions: Sequence[int] | np.ndarray) -> Sequence[str]:
    """`texts` at `positions`: a lazy view of spooled `Texts` (a worker reads them), else a list."""
    if isinstance(texts, Texts):
        return texts.take(positions)
    return [texts[i] for i in positions]


class Spool:
    """Document lines appended to `path` by `add`; `close` gives the table to read them back by."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._out = open(self.path, "wb")  # noqa: SIM115 (a writer open across merge; close())
        self._end = 0
        self._sources: dict[str, int] = {}
        self.readable_at = str(self.path)  # where engine workers read the texts (`share`)
        self._columns = {name: array("Q" if name.startswith("hash") else "q") for name in COLUMNS}

    def add(self, doc: Doc, digest: bytes) -> None:
        """One document, `digest` its 16-byte (or longer) text hash."""
        line = (json.dumps(doc, ensure_ascii=False) + "\n").encode()
        self._out.write(line)
        values = {"hash_hi": int.from_bytes(digest[:8], "big"), "hash_lo": int.from_bytes(digest[8:16], "big"),
                  "source": self._sources.setdefault(doc["source"], len(self._sources)),
                  "offset": self._end, "size": len(line), "text_bytes": text_bytes(doc["text"])}
        for name, value in values.items():
            self._columns[name].append(value)
        self._end += len(line)

    def close(self) -> DocTable:
        self._out.close()
        columns = {name: np.frombuffer(values, np.uint64 if name.startswith("hash") else np.int64)
                   for name, values in self._columns.items()}
        columns["source"] = columns["source"].astype(np.int32)
        return DocTable(sources=tuple(self._sources), **columns)

    def share(self, location: str) -> None:
        """After `close`: workers read the texts from a copy at `location` (a URL on the artifact
        store's bucket, when they share no disk with this machine)."""
        if location != str(self.path):
            publish_file(self.path, location, keep=True)
            self.readable_at = location

    def texts(self, docs: DocTable) -> Texts:
        """The texts of `docs`, lazily, where engine workers can read them."""
        return Texts(self.readable_at, docs.offset, docs.size)

    def lines(self, docs: DocTable) -> Iterator[bytes]:
        """The output lines of `docs`, in that order."""
        with open(self.path, "rb") as f:
            for lo in range(0, len(docs), _BLOCK):
                for offset, size in zip(docs.offset[lo:lo + _BLOCK].tolist(), docs.size[lo:lo + _BLOCK].tolist()):
                    f.seek(offset)
                    yield f.read(size)

    def doc(self, docs: DocTable, row: int) -> Doc:
        """One document, whole: for a review sample of a drop."""
        return json.loads(next(self.lines(docs.take(np.array([row])))))
