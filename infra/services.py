"""The embedded services a run starts when none is configured: Prefect's ephemeral API server and
MLflow's SQLite store, both under GRISTMILL_HOME.

Both create their database schema on first use (alembic migrations). Two runs starting at once
in a fresh home would migrate the same SQLite files together, and alembic fails the loser
("Online migration expected to match one row ..."). So start-up happens under an flock in
GRISTMILL_HOME: the first run creates the schemas, the second finds them in place. With
`PREFECT_API_URL` / `MLFLOW_TRACKING_URI` set, those servers own their schemas and only the
MLflow experiment is looked up (or created) under the lock. A home's databases start as copies of
migrated templates (infra/schemas.py) where the defaults place them.
"""
from __future__ import annotations

import os
from pathlib import Path

from core.files import locked
from infra import env, schemas

LOCK = "services.lock"


def start_embedded_services(home: Path) -> None:
    """Start Prefect's ephemeral API (unless PREFECT_API_URL is set) and create the MLflow store
    and experiment, one run at a time per home. The Prefect server started here is the one the
    flow then uses (Prefect keeps one per process). `gristmill up` (infra/stack.py) starts the
    standing servers instead; with its exports set, this only looks up the experiment."""
    with locked(home, LOCK):
        if not os.environ.get("PREFECT_API_URL"):
            from prefect.server.api.server import SubprocessASGIServer

            schemas.seed_prefect(Path(os.environ.get("PREFECT_HOME") or env.prefect_home(home)))
            SubprocessASGIServer().start()
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            schemas.seed_mlflow(home)
        from infra.tracking.runs import Tracker

        Tracker(home)
