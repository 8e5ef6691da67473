"""Engines the collect tests share."""
from __future__ import annotations

import tasks.collect.stage as collect
from core.stage import SerialEngine


class KilledAfter(SerialEngine):
    """Runs `n` work units, then dies as a killed worker would; other maps run. Counts the units
    it was given."""

    def __init__(self, n: int | None = None):
        self.n, self.units = n, 0

    def map(self, fn, items):
        if fn is not collect.process_unit:
            return super().map(fn, items)
        self.units += len(items)
        if self.n is not None and self.n < len(items):
            super().map(fn, items[: self.n])
            raise RuntimeError("worker killed")
        return super().map(fn, items)


def spooled_table(path, texts, source: str = "s"):
    """`texts` spooled to one file as a work unit spools its kept documents, and their table."""
    from tasks.collect.spool import SpoolWriter, TableBuilder

    table = TableBuilder()
    with open(path, "wb") as f:
        spool = SpoolWriter(f)
        for i, text in enumerate(texts):
            offset, size = spool.add({"id": f"{i:016x}", "text": text, "source": source, "url": None,
                                      "language": "en"})
            table.add(source, i.to_bytes(16, "big"), 0, offset, size, len(text.encode()))
    return table.table([str(path)])
