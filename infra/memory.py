"""Peak resident memory of a stage: this process and every process it started (Ray workers,
Accelerate children), sampled by a background thread.

`ru_maxrss` would give only this process's lifetime peak (not one stage's, and not its workers'),
so the sum of RSS over the process tree is sampled every `interval_s`; a spike shorter than the
interval can be missed, so the figure is a lower bound on the true peak. The same samples give
the peak of this process alone (the driver of a data stage's map) and of the largest other process
of the tree (a Ray worker, a rank), which a cost per document or per worker is read from.

Finding the tree reads the parent of every process on the machine, so it is redone only every
`tree_every_s`; the samples in between read the RSS of the processes already found. The sampler
runs beside the stage's workers, on their cores: what it costs comes out of theirs.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time

import psutil

MB = 1024 * 1024


def tree_rss_bytes(root: psutil.Process) -> int:
    """Resident bytes of `root` and all its descendants now (processes that vanish count 0)."""
    return sum(_tree_rss(root))


def _tree_rss(root: psutil.Process, descendants: list[psutil.Process] | None = None) -> list[int]:
    """Resident bytes of `root` (first) and of each of its descendants now (vanished: 0);
    `descendants`: those found earlier, instead of looking for them again."""
    if descendants is None:
        descendants = root.children(recursive=True)
    sizes = []
    for proc in [root, *descendants]:
        try:
            sizes.append(proc.memory_info().rss)
        except psutil.Error:
            sizes.append(0)
    return sizes


class PeakRSS:
    """`with PeakRSS() as peak: ...` then `peak.mb`: the largest tree RSS seen while inside;
    `peak.own_mb` and `peak.child_mb` that of this process and of its largest descendant."""

    def __init__(self, interval_s: float = 0.2, tree_every_s: float = 1.0):
        self.interval_s = interval_s
        self.tree_every_s = tree_every_s
        self.peak_bytes = self.own_bytes = self.child_bytes = 0
        self._stop = threading.Event()
        self._root = psutil.Process()
        self._descendants: list[psutil.Process] = []
        self._thread = threading.Thread(target=self._sample, name="gristmill-peak-rss", daemon=True)

    def _sample(self) -> None:
        found_at = -math.inf
        while True:
            if time.monotonic() - found_at >= self.tree_every_s:
                self._find_tree()
                found_at = time.monotonic()
            self._record()
            if self._stop.wait(self.interval_s):
                return

    def _find_tree(self) -> None:
        with contextlib.suppress(psutil.Error):  # a process vanished mid-walk: next time
            self._descendants = self._root.children(recursive=True)

    def _record(self) -> None:
        own, *children = _tree_rss(self._root, self._descendants)
        self.peak_bytes = max(self.peak_bytes, own + sum(children))
        self.own_bytes = max(self.own_bytes, own)
        self.child_bytes = max(self.child_bytes, *children, 0)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._find_tree()
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
