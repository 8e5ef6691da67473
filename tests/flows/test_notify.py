"""Notifications: a failed run POSTs a JSON message to the configured webhook (a local HTTP
server here) and emits a Prefect event; the webhook URL, a secret, is never logged or tracked;
loss-spike rollbacks are read from a training stage's metrics."""
from __future__ import annotations

import http.server
import json
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from pipeline_helpers import REPO, cli_env

from gristmill.core.stage import Manifest
from gristmill.flows.notify import NotifyConfig, rollbacks


def test_the_webhook_is_named_by_reference_never_given_as_url():
    assert NotifyConfig(webhook="env:TEAM_HOOK").webhook == "env:TEAM_HOOK"
    with pytest.raises(ValueError, match="not the URL"):
        NotifyConfig(webhook="https://hooks.example/T000/B000/secret")


def test_rollbacks_are_read_from_the_stage_metrics(tmp_path):
    rows = [{"step": 10, "loss": 3.0}, {"step": 8, "rollback": 1, "rollback_from_step": 11,
                                        "rollback_reason": "spike", "rollback_loss": 40.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = Manifest(stage="pretrain", key="k", path=tmp_path, config={}, upstream={}, files={},
                        stats={"rollbacks": 1})
    assert rollbacks(manifest) == [{"step": 8, "rollback": 1, "rollback_from_step": 11,
                                    "rollback_reason": "spike", "rollback_loss": 40.0}]


@pytest.fixture
def webhook():
    """A local HTTP server on 127.0.0.1 that keeps the JSON bodies POSTed to it."""
    received: list[dict] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook-secret-7f3a", received
    server.shutdown()


def _failed_run_events(api_url: str, resource_id: str, timeout_s: float = 60) -> list[str]:
    """The resource ids of the `gristmill.run.failed` events about `resource_id` the Prefect server
    at `api_url` holds, once it holds one: it stores the events it receives a moment later."""
    body = json.dumps({"filter": {"event": {"name": ["gristmill.run.failed"]},
                                  "resource": {"id": [resource_id]}}, "limit": 50}).encode()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(f"{api_url}/events/filter", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with opener.open(request, timeout=30) as response:
            found = [e["resource"]["prefect.resource.id"] for e in json.loads(response.read())["events"]]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.slow
def test_a_failed_run_posts_to_the_webhook_and_emits_a_prefect_event(prefect_server, tmp_path, webhook):
    """Against the session's standing Prefect server (the run starts none of its own), where the
    event is looked up by its resource."""
    url, received = webhook
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"no_text": 1}\n')  # every record quarantined: collect fails
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", f"collect.sources=[{bad}]",
         "notify.webhook=env:GRISTMILL_TEST_HOOK", "--until", "collect"], cwd=REPO,
        env={**cli_env(home, prefect_server), "GRISTMILL_TEST_HOOK": url}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 2  # the user's data: one line (flows/supervised.py), after the webhook
    [message] = received
    assert message["event"] == "gristmill.run.failed" and message["stage"] == "collect"
    assert "no source yielded a document" in message["error"]
    run_id = message["run"]["mlflow_run_id"]
    resource = f"gristmill.pipeline-run.{run_id}"
    assert _failed_run_events(prefect_server["PREFECT_API_URL"], resource) == [resource]
    with sqlite3.connect(home / "mlflow.db") as db:
        params = dict(db.execute("select key, value from params where run_uuid = ?", (run_id,)))
    assert "collect.sources" in params and not any(k.startswith("notify") for k in params)
    assert "hook-secret-7f3a" not in proc.stdout + proc.stderr + json.dumps(params)
