"""Peak resident memory of a stage: this process and every process it started (Ray workers,
Accelerate children), sampled by a background thread.

`ru_maxrss` would give only this process's lifetime peak (not one stage's, and not its workers'),
so the sum of RSS over the process tree is sampled every `interval_s`; a spike shorter than the
interval can be missed, so the figure is a lower bound on the true peak. The same samples give
the peak of this process alone (the driver of a data stage's map) and of the largest other process
of the tree (a Ray worker, a rank), which a cost per document or per worker is read from.
"""
from __future__ import annotations

import threading

import psutil

MB = 1024 * 1024


def tree_rss_bytes(root: psutil.Process) -> int:
    """Resident bytes of `root` and all its descendants now (processes that vanish count 0)."""
    return sum(_tree_rss(root))


def _tree_rss(root: psutil.Process) -> list[int]:
    """Resident bytes of `root` (first) and of each of its descendants now (vanished: 0)."""
    sizes = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            sizes.append(proc.memory_info().rss)
        except psutil.Error:
            sizes.append(0)
    return sizes


class PeakRSS:
    """`with PeakRSS() as peak: ...` then `peak.mb`: the largest tree RSS seen while inside;
    `peak.own_mb` and `peak.child_mb` that of this process and of its largest descendant."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.peak_bytes = self.own_bytes = self.child_bytes = 0
        self._stop = threading.Event()
        self._root = psutil.Process()
        self._thread = threading.Thread(target=self._sample, name="gristmill-peak-rss", daemon=True)

    def _sample(self) -> None:
        while True:
            self._record()
            if self._stop.wait(self.interval_s):
                return

    def _record(self) -> None:
        own, *children = _tree_rss(self._root)
        self.peak_bytes = max(self.peak_bytes, own + sum(children))
        self.own_bytes = max(self.own_bytes, own)
        self.child_bytes = max(self.child_bytes, *children, 0)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._record()

    @property
    def mb(self) -> float:
        return round(self.peak_bytes / MB, 1)

    @property
    def own_mb(self) -> float:
        return round(self.own_bytes / MB, 1)

    @property
    def child_mb(self) -> float:
        return round(self.child_bytes / MB, 1)
