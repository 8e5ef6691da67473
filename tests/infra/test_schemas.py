"""New homes' databases start as copies of migrated templates (infra/schemas.py)."""
from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from gristmill.infra import schemas


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRISTMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GRISTMILL_SCHEMA_TEMPLATES", raising=False)
    return tmp_path / "cache"


def rows(db: Path) -> dict[str, int]:
    """Row count of every table that has rows."""
    with sqlite3.connect(db) as conn:
        tables = [name for (name,) in conn.execute("select name from sqlite_master where type = 'table'")]
        counts = {t: conn.execute(f'select count(*) from "{t}"').fetchone()[0] for t in tables}
    conn.close()
    return {t: n for t, n in counts.items() if n}


def test_an_mlflow_home_from_the_template_holds_its_own_experiments(cache, tmp_path):
    """The template is what MLflow's migrations write (the schema, its revision, the default
    workspace) and no experiment; the store opened on a seeded home adds MLflow's Default
    experiment and ours, both with artifacts under that home, not under the cache."""
    from gristmill.infra import env
    from gristmill.infra.tracking.runs import EXPERIMENT, Tracker

    home = tmp_path / "home"
    assert schemas.seed_mlflow(home)
    template = schemas.template_path("mlflow")
    built = rows(template)
    assert built["alembic_version"] == 1 and "experiments" not in built
    tracker = Tracker(home)
    experiments = {e.name: e.artifact_location for e in tracker.client.search_experiments()}
    assert experiments[EXPERIMENT] == env.mlflow_artifacts_root(home).as_uri()
    assert str(cache) not in experiments["Default"]
    assert not schemas.seed_mlflow(home)  # a home's database is never replaced
    assert rows(template) == built


def test_an_existing_database_is_left_alone(cache, tmp_path):
    db = tmp_path / "home" / "mlflow.db"
    db.parent.mkdir()
    db.write_bytes(b"someone else's")
    assert not schemas.seed("mlflow", db)
    assert db.read_bytes() == b"someone else's"
    assert not list(db.parent.glob("*.partial"))


def test_a_template_that_fails_to_build_leaves_the_database_to_its_server(cache, tmp_path, monkeypatch, caplog):
    def broken(work: Path) -> Path:
        raise RuntimeError("migrations failed")

    monkeypatch.setitem(schemas.BUILDERS, "mlflow", broken)
    with caplog.at_level(logging.WARNING, "gristmill.schemas"):
        assert not schemas.seed_mlflow(tmp_path / "home")
    assert "migrations failed" in caplog.text
    assert not (tmp_path / "home" / "mlflow.db").exists()
    assert [p.name for p in (cache / "schemas").iterdir()] == ["mlflow.lock"]


def test_switched_off_nothing_is_seeded(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("GRISTMILL_SCHEMA_TEMPLATES", "0")
    assert not schemas.seed_mlflow(tmp_path / "home")
    assert not (cache / "schemas").exists()


def test_another_set_of_migrations_gets_another_template(cache, tmp_path, monkeypatch):
    mine = schemas.template_path("mlflow")
    fake = tmp_path / "pkg" / "store" / "db_migrations" / "versions"
    fake.mkdir(parents=True)
    (fake / "0001_more.py").write_text("")
    spec = type("Spec", (), {"origin": str(tmp_path / "pkg" / "__init__.py")})
    monkeypatch.setattr(schemas.util, "find_spec", lambda name: spec)
    assert schemas.template_path("mlflow") != mine


@pytest.mark.slow
def test_a_seeded_prefect_home_serves_at_the_migrated_revision(tmp_path, monkeypatch):
    """Prefect's template is built by `prefect server database upgrade`; a server started on the
    copy finds nothing to migrate (same alembic revision before and after) and answers. The test
    session's cache (tests/conftest.py) holds the template when an earlier run built it: the build
    itself is not what this checks, so it is not paid twice."""
    monkeypatch.delenv("PREFECT_API_DATABASE_CONNECTION_URL", raising=False)
    monkeypatch.delenv("GRISTMILL_SCHEMA_TEMPLATES", raising=False)
    prefect_home = tmp_path / "home" / "prefect"
    assert schemas.seed_prefect(prefect_home)
    db = prefect_home / "prefect.db"
    template = schemas.template_path("prefect")
    assert rows(template) == {"alembic_version": 1}

    def revision() -> str:
        with sqlite3.connect(db) as conn:
            (rev,) = conn.execute("select version_num from alembic_version").fetchone()
        conn.close()
        return rev

    before = revision()
    import subprocess
    import sys

    script = ("from prefect.server.api.server import SubprocessASGIServer as S; s = S(); s.start(); "
              "import httpx; print(httpx.get(s.api_url + '/health').json()); s.stop()")
    env = {"PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("True"), proc.stderr[-2000:]
    assert revision() == before
    assert rows(db)["block_type"] > 0  # the server used the copy: it registered its blocks there
