"""Migrated, empty databases for new homes.

A new home's Prefect database took its server over a hundred alembic migrations before it
answered, and MLflow's store more (timings: docs/benchmarks.md); every new GRISTMILL_HOME (a
test, an experiment, another project) paid that. The migrated schema is the same for every home
of one Prefect or MLflow install, so it is built once, by the tool's own migrations, into a
template under the user's cache (`$GRISTMILL_CACHE`, default `~/.cache/gristmill`), and copied
into a home whose database does not exist yet. A template holds what the migrations write (the
schema, alembic's revision row, MLflow's default workspace) and nothing a run writes. Its name
carries the tool's version and a digest of its migration scripts, so another install builds its
own. Building one that fails is logged and skipped: the server then
migrates the home's database itself, as it always could; so does every new database with
GRISTMILL_SCHEMA_TEMPLATES=0.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata, util
from pathlib import Path

from gristmill.core.cache import cache_root
from gristmill.core.files import locked
from gristmill.infra import env

log = logging.getLogger("gristmill.schemas")

# Where each tool keeps its SQLite migration scripts (package, folder inside it).
MIGRATIONS = {
    "prefect": ("prefect", "server/database/_migrations/versions/sqlite"),
    "mlflow": ("mlflow", "store/db_migrations/versions"),
}




def template_path(tool: str) -> Path:
    """The template of this environment's `tool` (prefect or mlflow): version and migrations."""
    package, folder = MIGRATIONS[tool]
    spec = util.find_spec(package)
    scripts = sorted(p.name for p in (Path(spec.origin).parent / folder).glob("*.py")) if spec and spec.origin else []
    digest = hashlib.sha256("\n".join(scripts).encode()).hexdigest()[:12]
    return cache_root() / "schemas" / f"{tool}-{metadata.version(package)}-{digest}.db"


def _migrate_prefect(work: Path) -> Path:
    """Prefect's own `prefect server database upgrade` on a new SQLite file (its default path
    under `work` as PREFECT_HOME)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_DATABASE_", "PREFECT_PROFILES"))}
    environ.update(PREFECT_HOME=str(work), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    proc = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                          env=environ, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"prefect server database upgrade exited {proc.returncode}: {proc.stderr[-2000:]}")
    return work / "prefect.db"


def _migrate_mlflow(work: Path) -> Path:
    """MLflow's own `mlflow db upgrade` on a new SQLite file (infra/tracking)."""
    from gristmill.infra.tracking import migrate_sqlite_store

    db = work / "mlflow.db"
    migrate_sqlite_store(db)
    return db


BUILDERS: dict[str, Callable[[Path], Path]] = {"prefect": _migrate_prefect, "mlflow": _migrate_mlflow}


def template(tool: str) -> Path | None:
    """The migrated template of `tool`, built now if missing (one builder at a time per cache);
    None if building failed (logged)."""
    path = template_path(tool)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path.parent, f"{tool}.lock"):
        if path.exists():  # another process built it while this one waited
            return path
        with tempfile.TemporaryDirectory(dir=path.parent) as work:
            try:
                db = BUILDERS[tool](Path(work))
                conn = sqlite3.connect(db)  # fold a write-ahead log into the file before moving it
                try:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    conn.execute("PRAGMA journal_mode=DELETE")
                finally:
                    conn.close()
            except Exception as exc:  # an optimisation: the server can migrate itself
                log.warning("no %s schema template (%s); the new database migrates itself", tool, exc)
                return None
            db.replace(path)
    return path


def seed(tool: str, db: Path) -> bool:
    """Copy `tool`'s template to `db` if no database is there yet; True if it did."""
    if db.exists() or os.environ.get("GRISTMILL_SCHEMA_TEMPLATES") == "0":
        return False
    source = template(tool)
    if source is None:
        return False
    db.parent.mkdir(parents=True, exist_ok=True)
    partial = db.with_name(f"{db.name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(source, partial)
        os.link(partial, db)  # never over a database a server created meanwhile
    except FileExistsError:
        return False
    finally:
        partial.unlink(missing_ok=True)
    return True


def seed_prefect(prefect_home: Path) -> bool:
    """A new home's Prefect database, where Prefect's default puts it (unless a database URL is
    configured)."""
    if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        return False
    return seed("prefect", Path(prefect_home) / "prefect.db")


def seed_mlflow(home: Path) -> bool:
    """A new home's MLflow SQLite store (env.mlflow_store_uri)."""
    return seed("mlflow", Path(env.mlflow_store_uri(home).removeprefix("sqlite:///")))
