"""Peak RSS of a stage counts this process and the processes it starts (Ray workers), and keeps
this process's own peak and the largest child's apart."""
from __future__ import annotations

import subprocess
import sys
import time

from gristmill.infra.memory import PeakRSS, tree_rss_bytes

MB = 1024 * 1024


def test_peak_sees_memory_allocated_and_freed_inside():
    with PeakRSS(interval_s=0.05) as before:
        time.sleep(0.2)
    with PeakRSS(interval_s=0.05) as peak:
        block = bytearray(300 * MB)  # zero-filled: the pages are touched
        time.sleep(0.3)
        del block
    assert peak.mb - before.mb > 250 and peak.own_mb - before.own_mb > 250  # ours, not a child's


def test_peak_counts_child_processes():
    import psutil

    code = "import time; b = bytearray(300 * 1024 * 1024); time.sleep(3)"
    with PeakRSS(interval_s=0.05) as peak:
        child = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(2)
        assert tree_rss_bytes(psutil.Process()) > 300 * MB
        child.wait()
    alone = tree_rss_bytes(psutil.Process())
    assert peak.peak_bytes - alone > 250 * MB
    assert peak.child_mb > 300 and peak.own_mb < peak.mb - 250  # the child's 300 MB are not ours


def test_the_tree_is_looked_for_every_tree_every_s_not_every_sample(monkeypatch):
    import psutil

    walks = []
    children = psutil.Process.children

    def counted(self, recursive=False):
        walks.append(time.monotonic())
        return children(self, recursive=recursive)

    monkeypatch.setattr(psutil.Process, "children", counted)
    with PeakRSS(interval_s=0.01, tree_every_s=0.25) as peak:
        time.sleep(1.0)
    # ~100 samples, ~4 walks (+1 at the end); each walk reads every process on the machine
    assert 3 <= len(walks) <= 7, walks
    assert peak.own_mb > 0
