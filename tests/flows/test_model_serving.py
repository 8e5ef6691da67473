"""The champion of the shared tiny run, served and loaded as the README shows: `mlflow models serve
-m models:/gristmill-tiny@champion --env-manager local` on 127.0.0.1 answers a chat request with
generated text, and `mlflow.pyfunc.load_model` in a fresh process gives the same reply. Offline:
the model and its tokenizer come from the run's tracking store. The same store reused under a
tracking server whose artifacts live in a bucket back-fills every stage there, and its champion is
served from the bucket in a directory and home that hold no copy."""
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
from pipeline_helpers import STAGES, cli_env, gristmill

from gristmill.infra.launch import free_port

pytestmark = pytest.mark.slow

CHAMPION = "models:/gristmill-tiny@champion"
REQUEST = {"messages": [{"role": "user", "content": "What is 12 + 7?"}], "max_tokens": 16}
# What the README's `mlflow.pyfunc.load_model` line does, in a process of its own.
LOAD = f"""import json, sys, mlflow
model = mlflow.pyfunc.load_model({CHAMPION!r})
print(json.dumps({{"model_id": model.metadata.model_id, "reply": model.predict(json.loads(sys.argv[1]))}}))"""
UP_WITHIN_S = 180  # ~10 s on an idle 2-core machine


def _serve(env: dict[str, str], cwd: Path, log: Path) -> tuple[subprocess.Popen, int]:
    """`mlflow models serve` of the champion on a free port of 127.0.0.1, in a session of its own."""
    port = free_port()
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", CHAMPION, "--env-manager", "local",
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return server, port


def _stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)  # the server and the uvicorn it started
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


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

    from gristmill.core.chat import prompt_ids

    home = tiny_run.home
    store = f"sqlite:///{home}/mlflow.db"
    # `mlflow models serve` starts `uvicorn` from PATH: this interpreter's environment.
    env = {**cli_env(home), "MLFLOW_TRACKING_URI": store,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    log = tmp_path / "serve.log"
    server, port = _serve(env, tmp_path, log)
    try:
        # while the server starts
        loaded = subprocess.run([sys.executable, "-c", LOAD, json.dumps(REQUEST)], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert loaded.returncode == 0, loaded.stderr[-4000:]
        response = _reply(server, port, log)
    finally:
        _stop(server)
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


def test_under_a_server_with_bucket_artifacts_a_reused_store_backfills_and_its_champion_serves_from_the_bucket(
        tiny_run, s3_server, prefect_server, tmp_path, monkeypatch):
    import boto3
    from mlflow.tracking import MlflowClient

    from gristmill.infra import stack

    # `gristmill up`'s MLflow on a home of its own: artifacts in GRISTMILL_STORE's bucket by default
    monkeypatch.setenv("GRISTMILL_STORE", "s3://crawl/store")
    tracking_home = tmp_path / "tracking"
    try:
        [state] = stack.up(tracking_home, ports=stack.Ports.free(), names=("mlflow",))
        assert state.state == "running", stack.format_states([state])
        server = state.export
        # the shared run's committed outputs, reused: every stage's run and both chat models back-filled
        home = tiny_run.home_with(tmp_path / "home")
        log = gristmill(home, "run", "configs/tiny.yaml", *tiny_run.overrides, services={**server, **prefect_server})
        assert all(f"{stage}: reused" in log.stdout + log.stderr for stage in STAGES), log.stderr[-3000:]
        client = MlflowClient(server["MLFLOW_TRACKING_URI"])
        runs = client.search_runs([client.get_experiment_by_name("gristmill").experiment_id],
                                  "tags.`gristmill.kind` = 'stage'")
        assert sorted(r.data.tags["gristmill.stage"] for r in runs) == sorted(STAGES)
        # the logged models are objects in the bucket, not files of either home
        keys = [o["Key"] for page in boto3.client("s3").get_paginator("list_objects_v2").paginate(
            Bucket="crawl", Prefix=f"{stack.MLFLOW_BUCKET_PREFIX}/") for o in page.get("Contents", [])]
        assert sum(key.endswith("/MLmodel") for key in keys) >= 2, keys[:20]
        for folder in (tracking_home, home):
            assert not list(folder.rglob("MLmodel")), folder
        # served from another directory and home, through the tracking server only
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        env = {**cli_env(elsewhere / "home"), **server, "HOME": str(elsewhere),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        serving, port = _serve(env, elsewhere, tmp_path / "bucket-serve.log")
        try:
            response = _reply(serving, port, tmp_path / "bucket-serve.log")
        finally:
            _stop(serving)
        assert response.status_code == 200, response.text
        assert response.json()[0]["choices"][0]["message"]["content"].strip()
    finally:
        stack.down(tracking_home)
