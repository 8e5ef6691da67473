"""Engines and settings the collect tests share."""
from __future__ import annotations

from pathlib import Path

import gristmill.tasks.collect.stage as collect
from gristmill.core.stage import SerialEngine
from gristmill.flows.config import load_config

# The tiny preset's cleaning thresholds (configs/tiny.yaml): what a stage run on the demo's package
# docs needs (the defaults are the published web thresholds, which keep 2 of its documents), and what
# a `gristmill run configs/tiny.yaml` cleaned with.
TINY_CLEANING = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml").collect.model_dump(
    exclude_defaults=True)


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
    from gristmill.tasks.collect.output.spool import SpoolWriter, TableBuilder

    table = TableBuilder()
    with open(path, "wb") as f:
        spool = SpoolWriter(f)
        for i, text in enumerate(texts):
            offset, size = spool.add({"id": f"{i:016x}", "text": text, "source": source, "url": None,
                                      "language": "en"})
            table.add(source, i.to_bytes(16, "big"), 0, offset, size, len(text.encode()))
    return table.table([str(path)])
