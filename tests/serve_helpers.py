"""One stack (`gristmill up`'s Prefect server, MLflow server and Ray head) and one `gristmill serve`
of the tiny preset, for the tests that drive the `pipeline` deployment (the `served` fixture in
conftest.py: starting them costs minutes on 2 cores, so the tests share them), and the calls to
Prefect's REST API those tests make.

The served process carries a one-shot fault (core/faults.py) at a step-10 training checkpoint,
armed only by creating `Served.fault_armed`: the next run that writes one fails there, once.
"""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline_helpers import FAST, REPO, cli_env

from gristmill.core.faults import FAULT_ENV, FAULT_ONCE_ENV
from gristmill.infra import stack
from gristmill.infra.processes import interrupt

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
FAULT_POINT = "checkpoint:10"
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@dataclass(frozen=True, kw_only=True)
class Served:
    home: Path
    api: str  # PREFECT_API_URL: http://127.0.0.1:<port>/api; the UI is at the same origin
    deployment: dict
    log: Path  # the serve process's output
    fault_armed: Path

    @property
    def ui(self) -> str:
        return self.api.removesuffix("/api")


def api(base: str, path: str, body: dict | None = None, tries: int = 10) -> dict | list:
    """One call to Prefect's REST API (what the UI calls), retried while the server answers 503
    ("retry": its SQLite busy on a loaded machine; the request was rolled back), as Prefect's own
    client does."""
    request = urllib.request.Request(f"{base}{path}", method="GET" if body is None else "POST",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    for attempt in range(tries):
        try:
            with DIRECT.open(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code != 503 or attempt == tries - 1:
                raise
            time.sleep(2)


def wait(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    """`predicate()`'s first truthy value, asked every `poll_s` (a read of Prefect's API or a log
    file: cheap, and each waits on flow runs that end at any moment) until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def wait_finished(served: Served, flow_run_id: str, timeout_s: float = 900) -> dict:
    """The flow run once it is in a terminal state."""
    return wait(lambda: (run := api(served.api, f"/flow_runs/{flow_run_id}"))["state"]["type"] in TERMINAL
                and run, timeout_s, f"flow run {flow_run_id} to finish")


def mlflow_parents(home: Path, flow_run_id: str) -> list[str]:
    """The MLflow pipeline runs of one flow run (one per attempt), oldest first."""
    with sqlite3.connect(home / "mlflow.db") as db:
        return [r[0] for r in db.execute(
            "select r.run_uuid from runs r join tags t on t.run_uuid = r.run_uuid and "
            "t.key = 'prefect.flow_run_id' where t.value = ? order by r.start_time", (flow_run_id,))]


def mlflow_params(home: Path, run_id: str) -> dict[str, str]:
    with sqlite3.connect(home / "mlflow.db") as db:
        return dict(db.execute("select key, value from params where run_uuid = ?", (run_id,)))


@contextmanager
def serving(root: Path) -> Iterator[Served]:
    """The stack and `gristmill serve configs/tiny.yaml *FAST` for `root`, stopped on exit."""
    home = root / "home"
    home.mkdir()
    states = stack.up(home, ports=stack.Ports.free())
    process = None
    try:
        exports = {k: v for s in states for k, v in s.export.items()}
        log = root / "serve.log"
        armed = root / "fault-armed"
        with log.open("w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "gristmill", "serve", "configs/tiny.yaml", *FAST], cwd=REPO,
                env={**cli_env(home), **exports, FAULT_ENV: FAULT_POINT, FAULT_ONCE_ENV: str(armed)},
                stdout=out, stderr=subprocess.STDOUT)
        base = exports["PREFECT_API_URL"]
        deployment = wait(lambda: next((d for d in api(base, "/deployments/filter", {})
                                        if d["name"] == "pipeline"), None), 180, "the deployment")
        yield Served(home=home, api=base, deployment=deployment, log=log, fault_armed=armed)
    finally:
        if process is not None:
            interrupt(process, grace_s=60)
        stack.down(home)
