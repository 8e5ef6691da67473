"""Documents' texts read back lazily from JSON-lines files (`Texts`), and `take` for any sequence of
texts.

A `Texts` names files and, per document, which file, where in it its line is and how many bytes it
has; each line is a JSON object with a "text" field (output/spool.py's `SpoolWriter` writes them
and `DocTable.texts()` views them). It reads a text when it is asked for, slices and `take`s into
further lazy views, and pickles as the files it needs and three arrays, so an engine worker reads
its own chunk of the corpus (from the bucket, when the store is one). It is a reader, below
clean/, because the quality model's cross-fitting takes such views as near dedup does.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np

from gristmill.core.files import open_location

_BLOCK = 65_536  # documents whose positions are turned into Python numbers at once


class Texts(Sequence[str]):
    """The texts of spooled documents, read on demand (see the module docstring)."""

    def __init__(self, paths: Sequence[str], file: np.ndarray, offsets: np.ndarray, sizes: np.ndarray):
        self.paths, self.file, self.offsets, self.sizes = tuple(paths), file, offsets, sizes

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        return next(iter(self.take([i])))

    def take(self, positions: Sequence[int] | np.ndarray) -> Texts:
        """The texts at `positions`, in that order, as another lazy view (naming only the files
        it reads)."""
        positions = np.asarray(positions, dtype=np.int64)
        used, file = np.unique(self.file[positions], return_inverse=True)
        return Texts([self.paths[i] for i in used.tolist()], file.astype(np.int32),
                     self.offsets[positions], self.sizes[positions])

    def lines(self) -> Iterator[bytes]:
        """The documents' output lines, in order."""
        f: BinaryIO | None = None
        current = -1
        try:
            for lo in range(0, len(self), _BLOCK):  # no list of every document's numbers at once
                for file, offset, size in zip(self.file[lo:lo + _BLOCK].tolist(),
                                              self.offsets[lo:lo + _BLOCK].tolist(),
                                              self.sizes[lo:lo + _BLOCK].tolist()):
                    if file != current or f is None:  # f is None only before the first file
                        if f is not None:
                            f.close()
                        opened: BinaryIO = open_location(self.paths[file])
                        f, current = opened, file
                    f.seek(offset)
                    yield f.read(size)
        finally:
            if f is not None:
                f.close()

    def __iter__(self) -> Iterator[str]:
        return (json.loads(line)["text"] for line in self.lines())


def take(texts: Sequence[str], positions: Sequence[int] | np.ndarray) -> Sequence[str]:
    """`texts` at `positions`: a lazy view of spooled `Texts` (a worker reads them), else a list."""
    if isinstance(texts, Texts):
        return texts.take(positions)
    return [texts[i] for i in positions]
