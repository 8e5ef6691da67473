"""Injected faults: `fault_point(where)` marks a point where a crash is too short-lived to hit with
a timed kill, so the fault suite (`python -m bench chaos`) and the tests can stop a run exactly
there. Points: `commit:<stage>` (a stage's manifest written, its directory not yet renamed into
place; infra/artifacts.py), `checkpoint-files:<step>` (a training checkpoint's files written, its
marker not yet) and `checkpoint:<step>` (a training checkpoint of that step just put in place;
model/checkpoint.py).

    GRISTMILL_FAULT=<point>                  the process dies there as a crash would (SIGKILL)
    GRISTMILL_FAULT_ONCE=<file> (with it)    instead the point raises InjectedFault, and only
                                             while <file> exists; it removes the file first

The second form fails one run in a stage the ordinary way (an exception: the stage and the run
are FAILED, not crashed) and lets the same run, retried, pass the point: a test arms it by
creating the file, and a long-lived process (`gristmill serve`) keeps the variables for its runs.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

FAULT_ENV = "GRISTMILL_FAULT"
FAULT_ONCE_ENV = "GRISTMILL_FAULT_ONCE"


class InjectedFault(RuntimeError):
    """Raised by an armed one-shot fault point."""


def fault_point(where: str) -> None:
    """Die (or raise once, see the module doc) when $GRISTMILL_FAULT names this point."""
    if os.environ.get(FAULT_ENV) != where:
        return
    if not (once := os.environ.get(FAULT_ONCE_ENV)):
        os.kill(os.getpid(), signal.SIGKILL)
        return  # not reached: SIGKILL ends this process
    try:
        Path(once).unlink()  # atomic: of two processes reaching the point, one raises
    except FileNotFoundError:
        return  # not armed, or already fired
    raise InjectedFault(f"injected fault at {where} ({FAULT_ENV}; armed by {once})")
