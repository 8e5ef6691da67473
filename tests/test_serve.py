"""`gristmill serve`: the `pipeline` deployment on a real Prefect server (`gristmill up`'s stack),
its typed parameter form, and a run started through the API the UI uses, with a field changed,
that completes and records the changed value in MLflow."""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from pipeline_helpers import FAST, REPO, cli_env
from test_stack import _free_ports

from infra import stack

pytestmark = pytest.mark.slow
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _api(base: str, path: str, body: dict | None = None, tries: int = 10) -> dict | list:
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


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_served_deployment_has_a_typed_form_and_runs_with_a_changed_field(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    states = stack.up(home, ports=stack.Ports(*_free_ports(6)))
    served = None
    try:
        exports = {k: v for s in states for k, v in s.export.items()}
        api = exports["PREFECT_API_URL"]
        log = (tmp_path / "serve.log").open("w")
        served = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "configs/tiny.yaml", *FAST],
                                  cwd=REPO, env={**cli_env(home), **exports}, stdout=log,
                                  stderr=subprocess.STDOUT)
        deployment = _wait(lambda: next(iter(_api(api, "/deployments/filter", {})), None), 120,
                           "the deployment")
        assert deployment["name"] == "pipeline" and deployment["parameters"]["config"]["name"] == "tiny"
        schema = deployment["parameter_openapi_schema"]
        assert set(schema["properties"]) == {"config", "until", "overrides"}
        config_form = schema["definitions"]["PipelineConfig"]["properties"]
        assert config_form["sft"]["description"] == "Supervised fine-tuning on conversations."
        pretrain = schema["definitions"][config_form["pretrain"]["$ref"].split("/")[-1]]["properties"]
        assert pretrain["max_steps"]["type"] == "integer" and pretrain["max_steps"]["description"]

        run = _api(api, f"/deployments/{deployment['id']}/create_flow_run", {
            "parameters": {"until": "tokenize", "overrides": ["tokenize.vocab_size=2048"]}})
        state = _wait(lambda: (s := _api(api, f"/flow_runs/{run['id']}")["state"]["type"]) in
                      ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") and s, 900, "the flow run")
        assert state == "COMPLETED", (tmp_path / "serve.log").read_text()[-3000:]
        with sqlite3.connect(home / "mlflow.db") as db:
            [parent] = [r[0] for r in db.execute(
                "select run_uuid from tags where key = 'prefect.flow_run_id' and value = ?", (run["id"],))]
            params = dict(db.execute("select key, value from params where run_uuid = ?", (parent,)))
        assert params["tokenize.vocab_size"] == "2048" and params["pretrain.max_steps"] == "60"
    finally:
        if served is not None:
            served.send_signal(signal.SIGINT)
            served.wait(timeout=60)
        stack.down(home)
