"""Peak resident memory of a stage: this process and every process it started (Ray workers,
Accelerate children), sampled by a background thread.

`ru_maxrss` would give only this process's lifetime peak (not one stage's, and not its workers'),
so the sum of RSS over the process tree is sampled every `interval_s`; a spike shorter than the
interval can be missed, so the figure is a lower bound on the true peak.
"""
from __future__ import annotations

import contextlib
import threading

import psutil

MB = 1024 * 1024


def tree_rss_bytes(root: psutil.Process) -> int:
    """Resident bytes of `root` and all its descendants now (processes that vanish count 0)."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


class PeakRSS:
    """`with PeakRSS() as peak: ...` then `peak.mb`: the largest tree RSS seen while inside."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._root = psutil.Process()
        self._thread = threading.Thread(target=self._sample, name="gristmill-peak-rss", daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self._root))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self._root))

    @property
    def mb(self) -> float:
        return round(self.peak_bytes / MB, 1)
