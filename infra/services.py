"""The embedded services a run starts when none is configured: Prefect's ephemeral API server and
MLflow's SQLite store, both under GRISTMILL_HOME.

Both create their database schema on first use (alembic migrations). Two runs starting at once
in a fresh home would migrate the same SQLite files together, and alembic fails the loser
("Online migration expected to match one row ..."). So start-up happens under an flock in
GRISTMILL_HOME: the first run creates the schemas, the second finds them in place. With
`PREFECT_API_URL` / `MLFLOW_TRACKING_URI` set, those servers own their schemas and only the
MLflow experiment is looked up (or created) under the lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

LOCK = "services.lock"


@contextlib.contextmanager
def home_lock(home: Path, name: str = LOCK) -> Iterator[None]:
    """An exclusive flock on `home/name` for the duration of the block: one process at a time
    starts (or stops) services of one home. The OS releases it if the holder dies."""
    with (Path(home) / name).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def start_embedded_services(home: Path) -> None:
    """Start Prefect's ephemeral API (unless PREFECT_API_URL is set) and create the MLflow store
    and experiment, one run at a time per home. The Prefect server started here is the one the
    flow then uses (Prefect keeps one per process). `gristmill up` (infra/stack.py) starts the
    standing servers instead; with its exports set, this only looks up the experiment."""
    with home_lock(home):
        if not os.environ.get("PREFECT_API_URL"):
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().start()
        from infra.tracking import Tracker

        Tracker(home)
