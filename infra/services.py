"""The embedded services a run starts when none is configured: Prefect's ephemeral API server and
MLflow's SQLite store, both under GRISTMILL_HOME.

Prefect's server takes seconds to boot (its own imports, the app, the database), and so do the
run's imports of Prefect and MLflow. So `EmbeddedServices.launch` starts the server as soon as the
run is planned, before this process imports Prefect, and `ready` waits for it after the imports:
the two overlap on separate cores (docs/benchmarks.md). It is the server Prefect would start for
itself (`SubprocessASGIServer`'s command and settings), on a free loopback port named by
PREFECT_API_URL in this process's environment, which Prefect reads when it is imported; the
marker `EMBEDDED_PREFECT` says that URL is the run's own server, which lives as long as the
process (stopped at exit, as Prefect stops its own), not a standing one a person can open
(flows/gates.py). A process that has imported Prefect already (a test, a notebook) gets Prefect's
own ephemeral server instead, started by `ready`.

Both create their database schema on first use (alembic migrations). Two runs starting at once
in a fresh home would migrate the same SQLite files together, and alembic fails the loser
("Online migration expected to match one row ..."). So start-up happens under an flock in
GRISTMILL_HOME, from `launch` until the server answers: the first run creates the schemas, the
second finds them in place. With `PREFECT_API_URL` / `MLFLOW_TRACKING_URI` set, those servers own
their schemas and only the MLflow experiment is looked up (or created) under the lock. A home's
databases start as copies of migrated templates (infra/schemas.py) where the defaults place them.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from gristmill.core.files import locked
from gristmill.infra import env, schemas
from gristmill.infra.stack import http_ok

LOCK = "services.lock"
EMBEDDED_PREFECT = "GRISTMILL_EMBEDDED_PREFECT"  # "1" beside PREFECT_API_URL: the run's own server
# Where Prefect puts its own ephemeral server: below the kernel's ephemeral ports (32768-), so no
# process binding port 0 (Ray's among them) takes it between choosing it and the server binding it.
PORTS = range(8000, 9000)
PORT_IN_USE_EXIT = 3  # uvicorn's, when the port was taken anyway
STOP_GRACE_S = 5.0


def is_embedded_prefect() -> bool:
    """Whether PREFECT_API_URL names the server this run started (EmbeddedServices)."""
    return os.environ.get(EMBEDDED_PREFECT) == "1" and bool(os.environ.get("PREFECT_API_URL"))


class EmbeddedServices:
    """`launch()` once the run is planned, `ready()` before its flow starts."""

    def __init__(self, home: Path):
        self.home = Path(home)
        self._lock = contextlib.ExitStack()
        self._server: subprocess.Popen | None = None
        self._port = 0

    def launch(self) -> None:
        """Start Prefect's API server now, without waiting for it, unless PREFECT_API_URL is set
        or Prefect is imported already (it has read its settings then)."""
        if os.environ.get("PREFECT_API_URL") or "prefect" in sys.modules:
            return
        self._lock.enter_context(locked(self.home, LOCK))
        self._seed_prefect()
        self._start_server()
        atexit.register(self.stop)
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{self._port}/api"
        os.environ[EMBEDDED_PREFECT] = "1"
        os.environ["PREFECT_UI_URL"] = ""  # it serves no UI: no "View at" links to it

    def ready(self) -> None:
        """Wait until the launched server answers (or start Prefect's own ephemeral one), and
        create the MLflow store and experiment. The server started here is the one the flow then
        uses. `gristmill up` (infra/stack.py) starts standing servers instead; with its exports
        set, this only looks up the experiment."""
        with self._lock:  # taken by `launch`, or now
            if self._server is None:
                self._lock.enter_context(locked(self.home, LOCK))
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                schemas.seed_mlflow(self.home)
            from gristmill.infra.tracking.runs import Tracker

            Tracker(self.home)  # first: while the launched server is still starting
            if self._server is not None:
                self._wait_for_server()
            elif not os.environ.get("PREFECT_API_URL"):
                from prefect.server.api.server import SubprocessASGIServer

                self._seed_prefect()
                SubprocessASGIServer().start()

    def stop(self) -> None:
        """Stop the launched server (at exit; idempotent)."""
        if self._server is None:
            return
        self._server.terminate()
        try:
            self._server.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        self._server = None

    def _seed_prefect(self) -> None:
        schemas.seed_prefect(Path(os.environ.get("PREFECT_HOME") or env.prefect_home(self.home)))

    def _start_server(self) -> None:
        """Prefect's ephemeral server as SubprocessASGIServer runs it, on a free port."""
        self._port = _free_port()
        spec = importlib.util.find_spec("prefect")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("Prefect is not installed in this environment")
        prefect_dir = spec.submodule_search_locations[0]
        self._server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect_dir).parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self._port),
             "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                 "PREFECT__SERVER_FINAL": "1"})

    def _wait_for_server(self) -> None:
        timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))
        deadline = time.monotonic() + timeout_s
        server = self._server
        if server is None:
            raise RuntimeError("Prefect's server was not started")
        while time.monotonic() < deadline:
            if server.poll() is not None:  # Prefect has read its URL: no other port now
                why = (f"port {self._port} was taken before it bound it" if server.returncode ==
                       PORT_IN_USE_EXIT else f"it exited with code {server.returncode}")
                raise RuntimeError(f"Prefect's server did not start: {why}")
            elif http_ok(f"http://127.0.0.1:{self._port}/api/health"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"Prefect's server did not answer within {timeout_s:.0f} s "
                           "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")


def _free_port() -> int:
    for port in random.sample(PORTS, len(PORTS)):
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port for Prefect's server in {PORTS.start}-{PORTS.stop - 1}")


def start_embedded_services(home: Path) -> None:
    """Launch and wait: for a caller with nothing to do in between."""
    services = EmbeddedServices(home)
    services.launch()
    services.ready()
