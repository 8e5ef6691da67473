"""The embedded services (infra/services.py): Prefect's server launched before Prefect is imported,
the run's own (no person is asked through it), gone with the process; a port taken in between is
named."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from bench.harness.runs import REPO, cli_env

LAUNCH = textwrap.dedent("""
    import json, os, sys, urllib.request
    import gristmill.flows.entry  # configures the process, as a run's child does
    from gristmill.infra import env, services
    {setup}
    embedded = services.EmbeddedServices(env.gristmill_home())
    embedded.launch()
    launched = {{"prefect_imported": "prefect" in sys.modules, "url": os.environ.get("PREFECT_API_URL")}}
    embedded.ready()
    from prefect.settings import PREFECT_API_URL
    from gristmill.flows.gates import person_can_answer
    with urllib.request.urlopen(launched["url"] + "/health", timeout=5) as response:
        health = response.status
    print(json.dumps({{**launched, "prefect_url": PREFECT_API_URL.value(), "health": health,
                      "person_can_answer": person_can_answer(), "server_pid": embedded._server.pid}}))
""")


def _launch(home: Path, setup: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LAUNCH.format(setup=setup)], cwd=REPO, env=cli_env(home),
                          capture_output=True, text=True, timeout=300)


def test_prefect_is_launched_before_its_import_and_used_by_the_run_until_exit(tmp_path):
    proc = _launch(tmp_path / "home")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["prefect_imported"]  # the server booted beside the imports that came after
    assert out["url"].startswith("http://127.0.0.1:") and out["prefect_url"] == out["url"]
    assert out["health"] == 200
    assert not out["person_can_answer"]  # a run's own server is no standing one: gates do not pause
    assert (tmp_path / "home" / "prefect" / "prefect.db").is_file()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(out["server_pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)  # stopped at exit: no server outlives its run
    assert not psutil.pid_exists(out["server_pid"]) or \
        psutil.Process(out["server_pid"]).status() == psutil.STATUS_ZOMBIE


def test_a_port_taken_before_the_server_binds_it_is_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _launch(tmp_path / "home", setup=f"services._free_port = lambda: {port}")
    assert proc.returncode != 0
    assert f"Prefect's server did not start: port {port} was taken before it bound it" in proc.stderr


def test_a_standing_server_is_left_to_its_owner(tmp_path, monkeypatch):
    """With PREFECT_API_URL set (`gristmill up`, a worker), nothing is launched and gates may ask."""
    from gristmill.flows.gates import person_can_answer
    from gristmill.infra.services import EmbeddedServices

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.delenv("GRISTMILL_EMBEDDED_PREFECT", raising=False)
    embedded = EmbeddedServices(tmp_path)
    embedded.launch()
    assert embedded._server is None and os.environ["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert person_can_answer()
