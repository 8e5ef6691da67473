"""The champion of the shared tiny run, served and loaded as the README shows: `mlflow models serve
-m models:/gristmill-tiny@champion --env-manager local` on 127.0.0.1 answers a chat request with
generated text, and `mlflow.pyfunc.load_model` in a fresh process gives the same reply. Offline:
the model and its tokenizer come from the run's tracking store."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from pipeline_helpers import cli_env

from infra.launch import free_port

pytestmark = pytest.mark.slow

CHAMPION = "models:/gristmill-tiny@champion"
REQUEST = {"messages": [{"role": "user", "content": "What is 12 + 7?"}], "max_tokens": 16}
# What the README's `mlflow.pyfunc.load_model` line does, in a process of its own.
LOAD = f"""import json, sys, mlflow
model = mlflow.pyfunc.load_model({CHAMPION!r})
print(json.dumps({{"model_id": model.metadata.model_id, "reply": model.predict(json.loads(sys.argv[1]))}}))"""
UP_WITHIN_S = 180  # ~10 s on an idle 2-core machine


def _reply(server: subprocess.Popen, port: int, log: Path) -> requests.Response:
    """The server's answer to REQUEST, once it is up; fails with its log if it exits or never
    comes up."""
    deadline = time.monotonic() + UP_WITHIN_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if requests.get(f"http://127.0.0.1:{port}/ping", timeout=5).ok:
                return requests.post(f"http://127.0.0.1:{port}/invocations", json=REQUEST, timeout=60)
        except requests.ConnectionError:
            time.sleep(0.5)
    pytest.fail(f"mlflow models serve never answered (exit {server.poll()}):\n{log.read_text()[-4000:]}")


def test_the_champion_is_served_and_loaded_in_a_fresh_process(tiny_run, tmp_path):
    from mlflow.tracking import MlflowClient
    from transformers import AutoTokenizer

    from core.chat import prompt_ids

    home = tiny_run.home
    store = f"sqlite:///{home}/mlflow.db"
    # `mlflow models serve` starts `uvicorn` from PATH: this interpreter's environment.
    env = {**cli_env(home), "MLFLOW_TRACKING_URI": store,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    port, log = free_port(), tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", CHAMPION, "--env-manager", "local",
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # while the server starts
        loaded = subprocess.run([sys.executable, "-c", LOAD, json.dumps(REQUEST)], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert loaded.returncode == 0, loaded.stderr[-4000:]
        response = _reply(server, port, log)
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the uvicorn it started
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert response.status_code == 200, response.text

    [served] = response.json()
    assert served["object"] == "chat.completion"
    message = served["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].strip(), served
    # rendered with the chat template stored with the aligned model's tokenizer
    version = MlflowClient(store).get_model_version_by_alias("gristmill-tiny", "champion")
    align_dir = next((home / "artifacts" / "align").glob(f"*-{version.tags['gristmill.key.align']}/model"))
    assert served["usage"]["prompt_tokens"] == len(prompt_ids(AutoTokenizer.from_pretrained(align_dir),
                                                              REQUEST["messages"]))
    # the same logged model, and greedy: the same reply in a fresh process
    fresh = json.loads(loaded.stdout.splitlines()[-1])
    assert version.source == f"models:/{fresh['model_id']}"
    assert fresh["reply"][0]["choices"] == served["choices"]
