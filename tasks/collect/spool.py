"""The kept documents on disk while the collect stage's corpus-level steps run, so the stage's
memory does not grow with the corpus.

`merge` appends each kept document's output line (`json.dumps(doc) + "\\n"`, byte for byte what a
docs shard holds) to one uncompressed file and keeps only a `DocRef` (funnel.py) per document:
its id, source, where its line is and its text's size. The steps read texts back in passes:
`Spool.texts(refs)` is a lazy sequence (`Texts`) that reads a text when it is asked for, slices
and `take`s into further lazy views, and pickles as a path and two arrays, so an engine worker
reads its own chunk of the corpus. The shards are written by copying lines.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tasks.collect.funnel import Doc, DocRef, text_bytes


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
        with open(self.path, "rb") as f:
            for offset, size in zip(self.offsets.tolist(), self.sizes.tolist()):
                f.seek(offset)
                yield json.loads(f.read(size))["text"]


def take(texts: Sequence[str], positions: Sequence[int] | np.ndarray) -> Sequence[str]:
    """`texts` at `positions`: a lazy view of spooled `Texts` (a worker reads them), else a list."""
    if isinstance(texts, Texts):
        return texts.take(positions)
    return [texts[i] for i in positions]


class Spool:
    """Document lines appended to `path` by `add`, read back once `close` has been called."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._out = open(self.path, "wb")  # noqa: SIM115 (a writer open across merge; close())
        self._end = 0

    def add(self, doc: Doc) -> DocRef:
        line = (json.dumps(doc, ensure_ascii=False) + "\n").encode()
        self._out.write(line)
        ref = DocRef(id=doc["id"], source=doc["source"], offset=self._end, size=len(line),
                     text_bytes=text_bytes(doc["text"]))
        self._end += len(line)
        return ref

    def close(self) -> None:
        self._out.close()

    def texts(self, docs: Sequence[DocRef]) -> Texts:
        offsets = np.fromiter((d.offset for d in docs), np.int64, len(docs))
        return Texts(str(self.path), offsets, np.fromiter((d.size for d in docs), np.int64, len(docs)))

    def lines(self, docs: Sequence[DocRef]) -> Iterator[bytes]:
        """The output lines of `docs`, in that order."""
        with open(self.path, "rb") as f:
            for doc in docs:
                f.seek(doc.offset)
                yield f.read(doc.size)

    def doc(self, ref: DocRef) -> Doc:
        """One document, whole: for a review sample of a drop."""
        return json.loads(next(self.lines([ref])))
