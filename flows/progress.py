"""A computing stage's progress in the Prefect UI: one progress artifact per stage, `progress-<stage>`.

`stage_progress(stage)` wraps a stage's computation in its Prefect task: reporters created inside
(core/progress.py: the training loop, engine maps, a launched stage's relayed progress) carry the
stage's name on the console bar and feed the artifact. The artifact is created at 0% when the
stage starts computing, shows the latest reporter's progress and line (`sft: train 300/1500 steps
(20%), 29.8 step/s, ETA 40 s, loss 2.31`), and reaches 100% when the stage has computed; a stage
that fails leaves it where it stopped.

Updates go out from a thread of their own, at most every ARTIFACT_EVERY_S: the stage only stores
the latest snapshot, so an API call never slows a step, and a Prefect server that is away or slow
never fails or stalls a stage (a warning is logged once; the stage waits at most FINISH_WAIT_S for
the last update when it ends). Outside a Prefect run, or with GRISTMILL_PROGRESS=off, there is no
artifact; the console bar works as before.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from typing import cast
from uuid import UUID

from gristmill.core import progress
from gristmill.core.progress import Snapshot

ARTIFACT_EVERY_S = 5.0  # an artifact update at most this often (one API call each)
FINISH_WAIT_S = 5.0  # a finished stage waits at most this long for its last update
log = logging.getLogger("gristmill.progress")


def artifact_key(stage: str) -> str:
    """Prefect artifact keys are lowercase letters, digits and dashes."""
    return "progress-" + "".join(c if c.isalnum() else "-" for c in stage.lower())


class StageArtifact:
    """The progress artifact of one stage's computation (a core.progress sink)."""

    def __init__(self, stage: str, every_s: float | None = None):
        self.stage, self.key = stage, artifact_key(stage)
        self.every_s = ARTIFACT_EVERY_S if every_s is None else every_s
        self.artifact_id: UUID | None = None
        self.pushed = 0  # API calls that succeeded
        self._starting = (0.0, f"{stage}: starting")
        self._latest: tuple[float, str] = self._starting
        self._sent: tuple[float, str] | None = None
        self._warned = False
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        # The thread runs in a copy of this context: Prefect's run context names the task and flow
        # run the artifact belongs to, and its settings the API.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), daemon=True,
                                        name=f"gristmill-progress-{stage}")
        self._thread.start()

    def update(self, snapshot: Snapshot) -> None:
        self._latest = (snapshot.percent, snapshot.describe())

    def finish(self, ok: bool) -> None:
        """The last update: 100% once the stage computed, else where it stopped."""
        percent, line = self._latest
        took = f"{self.stage}: done in {time.monotonic() - self._t0:.1f} s"
        reported = self._latest != self._starting  # a reporter ran: its last line says where it ended
        self._latest = (100.0, f"{took} ({line})" if reported else took) if ok else (percent, f"{line} (stopped)")
        self._stop.set()
        self._thread.join(FINISH_WAIT_S)
        if self._thread.is_alive():
            log.warning("progress artifact %s: the Prefect API did not take its last update within %.0f s; "
                        "the stage carries on", self.key, FINISH_WAIT_S)

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self._push()
            if stopping:
                return
            self._stop.wait(self.every_s)

    def _push(self) -> None:
        latest = self._latest
        if latest == self._sent:
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        percent, line = latest
        try:
            if self.artifact_id is None:
                # on this thread, which runs no event loop, async_dispatch calls the synchronous form
                self.artifact_id = cast(UUID, create_progress_artifact(percent, key=self.key, description=line))
            else:
                update_progress_artifact(self.artifact_id, percent, description=line)
        except Exception as error:  # never fail a stage over its progress display
            if not self._warned:
                self._warned = True
                log.warning("progress artifact %s not updated (%s: %s); the stage carries on",
                            self.key, type(error).__name__, error)
            return
        self._sent = latest
        self.pushed += 1


def _in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


@contextlib.contextmanager
def stage_progress(stage: str) -> Iterator[StageArtifact | None]:
    """Reporters inside carry `stage` in their label and, in a Prefect run, feed the stage's
    progress artifact (yielded; None when there is none)."""
    if progress.mode() == "off" or not _in_prefect_run():
        with progress.scope(stage):
            yield None
        return
    artifact = StageArtifact(stage)
    ok = False
    try:
        with progress.scope(stage, artifact):
            yield artifact
        ok = True
    finally:
        artifact.finish(ok)
