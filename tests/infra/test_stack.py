"""`gristmill up / status / down` (infra/stack.py) against real servers: a Prefect server, an MLflow
server and a Ray head on free ports (never 4200/5000: a user's stack may run beside the tests),
bound to 127.0.0.1 only, started once, stopped completely.

The slow test starts the three servers once (about a minute on a busy 2-core machine, most of
it Prefect's and MLflow's start-up); the fast ones need no server.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gristmill.flows import cli
from gristmill.infra import processes, stack, stack_auth
from gristmill.infra.processes import alive

LOOPBACK_IPS = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _port_flags(ports: stack.Ports) -> list[str]:
    return [arg for name, port in vars(ports).items() for arg in (f"--{name.replace('_', '-')}-port", str(port))]


def _dead_record(home: Path, name: str) -> None:
    """A pid file of a process that has exited, as a crash or a reboot leaves one."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = stack.services_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.pid").write_text(f"{gone.pid}\n")
    (folder / f"{name}.json").write_text(json.dumps({
        "name": name, "pid": gone.pid, "create_time": 1.0, "host": "127.0.0.1", "ports": [1],
        "health_url": "http://127.0.0.1:1/", "url": "http://127.0.0.1:1", "export": {}, "log": ""}))


def _listening(record: dict) -> set[tuple[str, int]]:
    addresses = set()
    for proc in processes.session(record["pid"], record["create_time"]):
        try:
            addresses |= {(c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet")
                          if c.status == psutil.CONN_LISTEN}
        except psutil.Error:  # a worker that exited meanwhile
            continue
    return addresses


def _status(url: str, body: bytes | None = None, credentials: str | None = None) -> int:
    """HTTP status of one GET (or POST of `body`), with basic-auth `credentials` if given."""
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    if credentials:
        request.add_header("Authorization", "Basic " + base64.b64encode(credentials.encode()).decode())
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as error:
        return error.code


def test_exposing_the_servers_needs_credentials_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path))
    for name in (stack.PREFECT_AUTH, stack.MLFLOW_AUTH):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["up", "--host", "0.0.0.0"]) == 2
    assert f"set {stack.PREFECT_AUTH} and {stack.MLFLOW_AUTH} first" in capsys.readouterr().err
    assert not list(stack.services_dir(tmp_path).glob("*.pid"))  # nothing started


def test_ports_that_cannot_work_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--ray-port 16379: inside the ports Ray gives its workers"):
        stack.Ports(ray=16379).check()
    with pytest.raises(ValueError, match="two services on one port"):
        stack.Ports(mlflow=4200).check()


def test_a_taken_port_fails_that_service_without_starting_it(tmp_path):
    ports = stack.Ports.free()
    taken = [socket.create_server(("127.0.0.1", port)) for port in (ports.prefect, ports.mlflow, ports.ray)]
    try:
        states = stack.up(tmp_path, ports=ports, timeout_s=5)
    finally:
        for sock in taken:
            sock.close()
        stack.down(tmp_path)
    assert [(s.name, s.state) for s in states] == [("prefect", "failed"), ("mlflow", "failed"), ("ray", "failed")]
    assert all("taken by a process gristmill did not start" in s.note for s in states)
    assert not list(stack.services_dir(tmp_path).glob("*.pid"))


def test_stale_pid_files_read_as_stopped_and_down_removes_them(tmp_path):
    for name in stack.NAMES:
        _dead_record(tmp_path, name)
    assert [s.state for s in stack.status(tmp_path)] == ["stopped"] * 3
    assert [s.note for s in stack.down(tmp_path)] == ["stale pid file removed"] * 3
    assert not list(stack.services_dir(tmp_path).iterdir())


def test_a_reused_pid_is_never_stopped(tmp_path):
    """A pid file whose pid now belongs to another process (here: this test's own) is stale."""
    _dead_record(tmp_path, "ray")
    record_file = stack.services_dir(tmp_path) / "ray.json"
    record = json.loads(record_file.read_text())
    record_file.write_text(json.dumps({**record, "pid": os.getpid()}))
    assert processes.session(os.getpid(), record["create_time"]) == []
    assert [s.note for s in stack.down(tmp_path)][2] == "stale pid file removed"  # and we still run


def test_a_service_that_exits_is_reported_with_its_log_and_forgotten(tmp_path, monkeypatch):
    crash = stack.Spec(name="prefect", env=dict(os.environ),
                       argv=(sys.executable, "-c", "print('no database'); raise SystemExit(3)"),
                       host="127.0.0.1", ports=(stack.Ports.free().prefect,),
                       health_url="http://127.0.0.1:1/", url="http://127.0.0.1:1")
    monkeypatch.setattr(stack, "specs", lambda *args: [crash])
    [state] = stack.up(tmp_path, timeout_s=30)
    assert state.state == "failed" and state.note.startswith("exited; see ") and state.pid is None
    assert "no database" in (stack.services_dir(tmp_path) / "prefect.log").read_text()
    assert not (stack.services_dir(tmp_path) / "prefect.pid").exists()


def test_services_keep_their_state_in_the_home_and_bind_where_told(tmp_path, monkeypatch):
    for name in (stack.PREFECT_AUTH, stack.MLFLOW_AUTH, stack_auth.MLFLOW_SECRET):
        monkeypatch.delenv(name, raising=False)
    local = {s.name: s for s in stack.specs(tmp_path)}
    assert "--app-name" not in local["mlflow"].argv  # no credentials set: no auth on loopback
    assert local["mlflow"].argv[local["mlflow"].argv.index("--backend-store-uri") + 1] == \
        f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert local["mlflow"].argv[local["mlflow"].argv.index("--artifacts-destination") + 1] == \
        (tmp_path.resolve() / "mlruns").as_uri()
    assert local["prefect"].env["PREFECT_HOME"] == str(tmp_path.resolve() / "prefect")
    assert "--node-ip-address" in local["ray"].argv and local["ray"].env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    monkeypatch.setenv(stack.PREFECT_AUTH, "team:secret")
    monkeypatch.setenv(stack.MLFLOW_AUTH, "another-Secret-123")
    exposed = {s.name: s for s in stack.specs(tmp_path, host="0.0.0.0")}
    assert exposed["prefect"].env[stack.PREFECT_AUTH] == "team:secret"
    mlflow_argv, mlflow_env = exposed["mlflow"].argv, exposed["mlflow"].env
    assert mlflow_argv[mlflow_argv.index("--app-name") + 1] == "basic-auth"
    assert f"sqlite:///{tmp_path.resolve()}/mlflow-auth.db" in Path(mlflow_env["MLFLOW_AUTH_CONFIG_PATH"]).read_text()
    assert len(mlflow_env[stack_auth.MLFLOW_SECRET]) == 64  # made once, kept beside the records
    assert (stack.services_dir(tmp_path) / "mlflow-secret-key").stat().st_mode & 0o777 == 0o600
    assert "--node-ip-address" not in exposed["ray"].argv  # Ray picks the node's network address
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in exposed["ray"].export
    assert exposed["prefect"].argv[exposed["prefect"].argv.index("--host") + 1] == "0.0.0.0"
    assert exposed["mlflow"].export == {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}  # reached locally


def test_ray_temp_dir_stays_short_enough_for_its_sockets(tmp_path):
    assert stack.ray_temp_dir(Path("/tmp/h")) == Path("/tmp/h/ray")
    deep = stack.ray_temp_dir(tmp_path / ("x" * 80))
    assert len(str(deep)) <= stack.RAY_TEMP_MAX_CHARS and deep == stack.ray_temp_dir(tmp_path / ("x" * 80))


@pytest.fixture
def restored_environ():
    """env.configure points os.environ at its home; later tests must not inherit it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_run_pointed_at_a_loopback_ray_keeps_it_loopback(tmp_path, monkeypatch, restored_environ):
    from gristmill.infra import env

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.delenv(env.RAY_SINGLE_MACHINE, raising=False)
    env.configure(tmp_path)
    assert os.environ[env.RAY_SINGLE_MACHINE] == "0"


@pytest.mark.slow
def _status_once_healthy(home: Path, timeout_s: float = 60) -> dict[str, stack.State]:
    """`status` soon after `up`: each health probe waits 3 s, which a loaded machine's server can
    miss (it then says `starting`), so ask again until all answer or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {s.name: s for s in stack.status(home)}
        if all(s.healthy for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def test_up_status_down(tmp_path_factory, monkeypatch, capsys):
    home = tmp_path_factory.mktemp("stack")
    monkeypatch.setenv("GRISTMILL_HOME", str(home))
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))  # where a careless ./mlruns would land
    ports = stack.Ports.free()
    _dead_record(home, "ray")  # a stale pid file: replaced, not trusted
    secrets = {stack.PREFECT_AUTH: "team:prefect-Secret-4411", stack.MLFLOW_AUTH: "mlflow-Secret-9923xy"}
    for name, value in {**secrets, "MLFLOW_TRACKING_USERNAME": "admin",
                        "MLFLOW_TRACKING_PASSWORD": secrets[stack.MLFLOW_AUTH]}.items():
        monkeypatch.setenv(name, value)  # basic auth on, as an exposed stack must have it
    try:
        assert cli.main(["up", *_port_flags(ports)]) == 0
        assert "basic auth is on" in capsys.readouterr().out
        first = _status_once_healthy(home)
        assert {n: (s.state, s.healthy) for n, s in first.items()} == {
            n: ("running", True) for n in ("prefect", "mlflow", "ray")}
        records = {n: json.loads((home / "services" / f"{n}.json").read_text()) for n in first}
        assert int((home / "services" / "ray.pid").read_text()) == first["ray"].pid

        # Loopback only: every listening socket of every process of the three sessions.
        for name, record in records.items():
            listening = _listening(record)
            assert {ip for ip, _ in listening} <= LOOPBACK_IPS, (name, listening)
            assert record["ports"][0] in {port for _, port in listening}, (name, listening)
        started = [p for r in records.values() for p in processes.session(r["pid"], r["create_time"])]
        assert len(started) > 3  # the servers' workers, Ray's GCS and raylet: all tracked

        # Basic auth: an API call without credentials is refused, with them it is served.
        prefect_api = f"http://127.0.0.1:{ports.prefect}/api/flows/filter"
        mlflow_api = f"http://127.0.0.1:{ports.mlflow}/api/2.0/mlflow/experiments/search?max_results=1"
        assert _status(prefect_api, b"{}") == 401 and _status(mlflow_api) == 401
        assert _status(prefect_api, b"{}", secrets[stack.PREFECT_AUTH]) == 200
        assert _status(mlflow_api, None, f"admin:{secrets[stack.MLFLOW_AUTH]}") == 200

        # A second `up` starts nothing and prints what to export.
        capsys.readouterr()
        assert cli.main(["up", "--print-env", *_port_flags(ports)]) == 0
        out, err = capsys.readouterr()
        assert out.strip() == (f"export PREFECT_API_URL=http://127.0.0.1:{ports.prefect}/api "
                               f"MLFLOW_TRACKING_URI=http://127.0.0.1:{ports.mlflow} "
                               f"RAY_ADDRESS=127.0.0.1:{ports.ray} RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0")
        assert err.count("already running") == 3
        assert {s.name: s.pid for s in stack.status(home)} == {n: s.pid for n, s in first.items()}

        # MLflow: the SQLite store and the served artifacts are under GRISTMILL_HOME.
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"http://127.0.0.1:{ports.mlflow}")
        run = client.create_run(client.create_experiment("stack-test"))
        client.log_text(run.info.run_id, "hello", "hello.txt")
        stored = list((home / "mlruns").rglob("hello.txt"))
        assert [p.read_text() for p in stored] == ["hello"]
        assert not Path("mlruns").exists() and not Path("mlartifacts").exists()
        assert (home / "mlflow.db").is_file() and (home / "prefect" / "prefect.db").is_file()
        # The secrets are in no record, log or command line `up` left behind.
        for path in (home / "services").iterdir():
            assert not any(v in path.read_text(errors="replace") for v in secrets.values()), path
    finally:
        capsys.readouterr()
        assert cli.main(["down"]) == 0
    assert "stopped pid" in capsys.readouterr().out
    assert alive(started) == []
    assert not list((home / "services").glob("*.pid"))
    assert cli.main(["status"]) == 3
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["stopped"] * 3
