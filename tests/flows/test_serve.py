"""`gristmill serve`: the `pipeline` deployment on a real Prefect server (`gristmill up`'s stack,
the `served` fixture) and its typed parameter form, as the UI draws it; and a served process that
stops promptly when its Prefect server went away first. Runs started from the UI, and Retry, are
tests/flows/test_serve_browser.py's."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from pipeline_helpers import REPO, cli_env

pytestmark = pytest.mark.slow


def test_the_served_deployment_has_a_typed_form(served):
    deployment = served.deployment
    assert deployment["name"] == "pipeline" and deployment["parameters"]["config"]["name"] == "tiny"
    schema = deployment["parameter_openapi_schema"]
    assert set(schema["properties"]) == {"config", "until", "overrides", "approve_gates"}
    assert schema["properties"]["approve_gates"]["default"] is False
    config_form = schema["definitions"]["PipelineConfig"]["properties"]
    assert config_form["sft"]["description"] == "Supervised fine-tuning on conversations."
    pretrain = schema["definitions"][config_form["pretrain"]["$ref"].split("/")[-1]]["properties"]
    collect = schema["definitions"][config_form["collect"]["$ref"].split("/")[-1]]["properties"]
    gates = schema["definitions"][collect["gates"]["$ref"].split("/")[-1]]["properties"]
    assert gates["max_removed_fraction"]["default"] == 0.99 and gates["min_kept_tokens"]["description"]
    assert pretrain["max_steps"]["type"] == "integer" and pretrain["max_steps"]["description"]
    # the served defaults are the config file with the command line's overrides (FAST)
    assert deployment["parameters"]["config"]["pretrain"]["max_steps"] == 60


def test_data_refresh_is_served_on_its_schedule(served):
    from serve_helpers import api, wait

    refresh = wait(lambda: next(iter(api(served.api, "/deployments/filter", {
        "deployments": {"name": {"any_": ["data-refresh"]}}})), None), 60, "the data-refresh deployment")
    # the served config's refresh.cron (default); `--refresh-cron` is tests/flows/test_refresh.py's
    assert [s["schedule"]["cron"] for s in refresh["schedules"] if s["active"]] == ["0 3 * * 1"]


def test_serve_stops_on_sigterm_after_its_prefect_server_is_gone(tmp_path, monkeypatch):
    """Prefect's runner, stopping, pauses its deployments on the server, and retries that for
    minutes when the server is gone; `gristmill serve` still stops within 10 s, leaving nothing.
    Only a Prefect server is started (by infra.stack, in a home of this test's own)."""
    from serve_helpers import api, wait

    from gristmill.infra import stack
    from gristmill.infra.processes import alive, process_tree

    home, log = tmp_path / "home", tmp_path / "serve.log"
    all_three = stack.specs
    monkeypatch.setattr(stack, "specs", lambda *args: [s for s in all_three(*args) if s.name == "prefect"])
    [prefect] = stack.up(home, ports=stack.Ports.free())
    proc = None
    try:
        assert prefect.state == "running", stack.format_states([prefect])
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "gristmill", "serve", "configs/tiny.yaml"],
                                    cwd=REPO, env={**cli_env(home), **prefect.export}, stdout=out,
                                    stderr=subprocess.STDOUT)
        wait(lambda: "being served" in log.read_text() or proc.poll() is not None, 300, "serve to start")
        assert proc.poll() is None, log.read_text()[-3000:]
        deployments = api(prefect.export["PREFECT_API_URL"], "/deployments/filter", {})
        assert "pipeline" in [d["name"] for d in deployments]
        served = process_tree(proc.pid)  # the supervisor, the served runner
        stack.down(home)  # the server goes first
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        seconds = time.monotonic() - started
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        stack.down(home)
    assert rc == 143 and seconds < 10, (rc, seconds, log.read_text()[-3000:])
    time.sleep(0.5)  # the kernel's bookkeeping of the last SIGKILLs
    assert alive(served) == [], [" ".join(p.cmdline()[:4]) for p in alive(served)]
