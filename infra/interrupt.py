"""A Ctrl-C that the pipeline cannot lose.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT arrives. Where
that is a finalizer or a weakref callback (a Ray or Prefect object collected mid-stage), Python
prints "Exception ignored in ..." and goes on, and the stage would run to its commit as if no one
had asked it to stop. So the process also remembers the signal (`catch_sigint`), and the points
past which a stop would lose its meaning ask (`stop_if_interrupted`): the artifact store before it
commits, the flow before each stage starts. A stopped stage keeps its partial output; the next run
resumes from it.
"""
from __future__ import annotations

import signal
import threading

_interrupted = threading.Event()


def _on_sigint(signum: int, frame: object) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def catch_sigint() -> None:
    """In the main thread of the process that runs the pipeline: SIGINT raises KeyboardInterrupt, as
    by default, and is remembered."""
    _interrupted.clear()
    signal.signal(signal.SIGINT, _on_sigint)


def stop_if_interrupted(what: str) -> None:
    """Raise KeyboardInterrupt if SIGINT arrived since `catch_sigint` (even where its first
    KeyboardInterrupt was swallowed); `what` is the step it stops."""
    if _interrupted.is_set():
        raise KeyboardInterrupt(f"interrupted by SIGINT before {what}")
