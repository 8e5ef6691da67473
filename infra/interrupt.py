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

import contextlib
import signal
import threading
from collections.abc import Iterator

_interrupted = threading.Event()


def _on_sigint(signum: int, frame: object) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def catch_sigint() -> Iterator[None]:
    """In the main thread of the process that runs the pipeline, around the run: SIGINT raises
    KeyboardInterrupt, as by default, and is remembered until the block ends."""
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _interrupted.clear()


def stop_if_interrupted(what: str) -> None:
    """Raise KeyboardInterrupt if SIGINT arrived inside `catch_sigint` (even where its first
    KeyboardInterrupt was swallowed); `what` is the step it stops."""
    if _interrupted.is_set():
        raise KeyboardInterrupt(f"interrupted by SIGINT before {what}")
