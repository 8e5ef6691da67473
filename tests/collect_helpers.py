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
