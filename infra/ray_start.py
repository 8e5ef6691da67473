"""A local Ray started ahead of need, on a thread of its own, while the process goes on.

A local Ray takes seconds to start (a dozen processes, each importing Ray), and so do the
imports and the Prefect server a run starts before its first stage. `gristmill run` knows from
its plan whether a stage that runs on Ray will compute: then it calls `start_early`, and the
flow hands that Ray (`take_early`) to the stage's `RayEngine` (infra/ray_engine.py), which works
on it instead of starting its own. As soon as Ray is up the thread also starts the engine's worker
actors, and each first calls the stage's `warm_worker` (the collect stage's loads Trafilatura,
the language-ID model and spaCy's tokenizer, ~2 s a worker), so that the workers load them while
the run waits for its Prefect server, not after. Nothing here imports Ray on the caller's thread:
the thread does.

The thread lives until the Ray it started is shut down, because Ray's processes are set to die
with the thread that started them (Linux's parent-death signal), not with the process. Ray's
`init` on the main thread makes SIGTERM exit the process by SystemExit, so that `finally` blocks
(the engine's shutdown among them) run; from another thread it cannot, so `start_early` does it.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading

_lock = threading.Lock()
_pending: EarlyRay | None = None


class EarlyRay:
    def __init__(self, num_workers: int, warm: str | None = None):
        self.num_workers = num_workers
        self.warm = warm
        self.workers: list = []  # the engine's actors, started (and warming) as soon as Ray is up
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.session_dir: str | None = None
        self._thread = threading.Thread(target=self._hold, name="gristmill-ray-start", daemon=True)

    def _hold(self) -> None:
        try:
            from infra.ray_engine import init_local, start_workers

            logging.getLogger("ray._private.worker").addFilter(_NOT_MAIN_THREAD_NOTE)

            self.session_dir = init_local(self.num_workers)
            self.workers = start_workers(self.num_workers, self.warm)
        except BaseException as error:  # raised where the Ray is taken, on the engine's thread
            self._error = error
        finally:
            self._ready.set()
        self._done.wait()

    def wait(self) -> EarlyRay:
        """Block until Ray has started; raise what starting it raised."""
        self._ready.wait()
        if self._error is not None:
            self.release()
            raise self._error
        return self

    def release(self) -> None:
        """Let the thread end: after `ray.shutdown()` (its processes are gone by then)."""
        self._done.set()
        self._thread.join()

    def stop(self) -> None:
        """Shut this Ray down (once started) and end its thread."""
        self._ready.wait()
        if self._error is None:
            from infra.ray_engine import shutdown_local

            shutdown_local(self.session_dir)
        self.release()


class _NotMainThreadNote(logging.Filter):
    """Drops Ray's warning that it set no SIGTERM handler off the main thread: `start_early` sets it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "current thread is not the main thread" not in record.getMessage()


# One instance: `addFilter` adds an object once, so each early start does not add another.
_NOT_MAIN_THREAD_NOTE = _NotMainThreadNote()


def _exit_on_sigterm(signum: int, _frame) -> None:
    sys.exit(signum)


def start_early(num_workers: int, warm: str | None = None) -> None:
    """Start a local Ray and its `num_workers` workers on a thread, each worker calling `warm`
    ("module.function", the stage's `warm_worker`) first; returns at once. Idempotent.
    Call it on the main thread."""
    global _pending
    with _lock:
        if _pending is None:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            _pending = EarlyRay(num_workers, warm)
            _pending._thread.start()


def take_early() -> EarlyRay | None:
    """The Ray `start_early` started, perhaps still starting (the taker waits for it with `wait`
    and ends it with `stop`, or with `release` after shutting Ray down); None when there is none."""
    global _pending
    with _lock:
        early, _pending = _pending, None
    return early


def stop_early() -> None:
    """Stop an early Ray that nothing took (the stage it was started for did not compute)."""
    if (early := take_early()) is not None:
        early.stop()
