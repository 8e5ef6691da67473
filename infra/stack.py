"""`gristmill up / status / down`: a standing Prefect server, MLflow tracking server and Ray head on
this machine, bound to 127.0.0.1 unless `--host` says otherwise, all state under GRISTMILL_HOME.
Exposed to the network, Prefect and MLflow must ask for credentials (basic auth, see
infra/stack_auth.py); on loopback they do when the same variables are set.

    gristmill up                          # start what is not running; print URLs and exports
    eval "$(gristmill up --print-env)"    # the same, and point this shell's runs at them
    gristmill status                      # per service: running/stopped, pid, URL, health
    gristmill down                        # stop exactly what `up` started

Each service runs in a session of its own; `$GRISTMILL_HOME/services/` holds `<name>.pid`,
`<name>.json` (what it serves, how to check it) and `<name>.log`. `down` stops every process of
that session — the servers' workers, Ray's GCS, raylet and workers — and nothing else (`ray stop`
would stop every Ray on the machine). A second `up` starts nothing that is already alive; a pid
file whose process is gone (or whose pid was reused) is replaced. Prefect keeps its database in
`$GRISTMILL_HOME/prefect` and MLflow uses the SQLite store and artifact folder under
GRISTMILL_HOME, so runs made with the embedded services (infra/services.py) and runs made
against these servers are one history.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import psutil

from gristmill.core import object_store
from gristmill.core.files import locked
from gristmill.core.sources import bucket_exists
from gristmill.infra import env, processes
from gristmill.infra.artifacts import STORE_ENV
from gristmill.infra.schemas import seed_mlflow, seed_prefect
from gristmill.infra.stack_auth import MLFLOW_AUTH, PREFECT_AUTH, check_exposure, mlflow_auth

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")
# What a shell may have exported from an earlier `up`: never passed to the servers themselves
# (`ray start --head` with RAY_ADDRESS set would try to join it); Ray's switch is set per host.
CLIENT_VARS = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", env.RAY_SINGLE_MACHINE)
# Ray's session sockets live at <temp>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store,
# ~66 characters below <temp>; a Unix socket path may not exceed 107.
RAY_TEMP_MAX_CHARS = 40
RAY_WORKER_PORTS = range(10002, 20000)  # `ray start`'s default --min/--max-worker-port
STACK_LOCK = "stack.lock"  # in GRISTMILL_HOME: one `up`/`down` at a time
STOP_GRACE_S = 10.0  # a service's time to exit on SIGTERM before it is killed
NAMES = ("prefect", "mlflow", "ray")  # the order `up` starts and reports them in
MLFLOW_BUCKET_PREFIX = "mlflow-artifacts"  # MLflow's artifacts in GRISTMILL_STORE's bucket


@dataclass(frozen=True, kw_only=True)
class Ports:
    """The ports `up` binds; defaults are each tool's own."""

    prefect: int = 4200
    mlflow: int = 5000
    ray: int = 6379  # Ray's GCS: RAY_ADDRESS
    ray_dashboard: int = 8265
    ray_client: int = 10001  # Ray Client (ray://)
    ray_agent: int = 52365  # the dashboard agent's HTTP port

    def check(self) -> None:
        """Fail before anything starts on ports that cannot work together."""
        given = vars(self)
        for name, port in given.items():
            if not 0 < port < 65536:
                raise ValueError(f"--{name.replace('_', '-')}-port {port}: not a port number")
            if name.startswith("ray") and port in RAY_WORKER_PORTS:
                raise ValueError(f"--{name.replace('_', '-')}-port {port}: inside the ports Ray gives its "
                                 f"workers ({RAY_WORKER_PORTS.start}-{RAY_WORKER_PORTS.stop - 1})")
        if len(set(given.values())) < len(given):
            raise ValueError(f"two services on one port: {given}")

    @classmethod
    def free(cls) -> Ports:
        """Ports nothing listens on now, outside the range Ray keeps for its workers (for a stack
        beside a user's own, in tests and benchmarks)."""
        names, ports = [f.name for f in fields(cls)], []
        while len(ports) < len(names):
            with socket.socket() as probe:
                probe.bind((LOOPBACK, 0))
                port = probe.getsockname()[1]
            if port not in RAY_WORKER_PORTS and port not in ports:
                ports.append(port)
        return cls(**dict(zip(names, ports)))


@dataclass(frozen=True, kw_only=True)
class Spec:
    """How to start one service and how to tell that it serves."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    host: str  # where to connect for the health check (127.0.0.1 for a wildcard bind)
    ports: tuple[int, ...]  # every fixed port it binds; the first is the service's own
    health_url: str  # answers 200 once the service is ready
    url: str  # what a person opens
    export: Mapping[str, str] = field(default_factory=dict)  # what clients set to use it


@dataclass(kw_only=True)
class State:
    """One service as `up` or `status` found (or left) it."""

    name: str
    state: str  # running | starting | stopped | failed
    pid: int | None = None
    url: str | None = None
    healthy: bool = False
    note: str = ""  # started, already running, why it failed
    export: dict[str, str] = field(default_factory=dict)


def services_dir(home: Path) -> Path:
    return Path(home) / "services"


def _tool(name: str) -> str:
    """The console script `name` of this environment (prefect, mlflow, ray)."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"`{name}` not found next to {sys.executable} or on PATH; "
                                "install gristmill's dependencies (pip install -e .)")
    return found


def ray_temp_dir(home: Path) -> Path:
    """Ray's temp root: under GRISTMILL_HOME when the path is short enough for Ray's sockets,
    else a short folder in /tmp named by a hash of the home (so one home, one folder)."""
    return env.short_path(Path(home).resolve() / "ray", RAY_TEMP_MAX_CHARS)


def artifacts_destination(home: Path, requested: str | None = None) -> str:
    """Where `up`'s MLflow server keeps artifacts (logged models among them): `requested`; else,
    when GRISTMILL_STORE is a bucket's URL (s3://, gs://), the `mlflow-artifacts` prefix of it, so a
    node with no shared disk serves the registry's models from the bucket; else under the home."""
    if requested:
        return requested.rstrip("/")
    store = os.environ.get(STORE_ENV, "")
    if object_store.is_object_store(store):  # the bucket's own scheme: MLflow writes s3:// and gs:// alike
        scheme, _, rest = store.partition("://")
        return f"{scheme}://{rest.split('/', 1)[0]}/{MLFLOW_BUCKET_PREFIX}"
    return env.mlflow_artifacts_root(home).as_uri()


def check_destination(url: str) -> None:
    """An object-store destination's bucket answers with the credentials at hand: ValueError in one
    line naming it otherwise (MLflow's server would start and fail only at the first upload)."""
    if url.startswith("file:"):
        return
    bucket = "/".join(url.split("/", 3)[:3])
    if not bucket_exists(bucket):
        raise ValueError(f"--artifacts-destination {url}: the bucket {bucket} does not exist")


def specs(home: Path, host: str = LOOPBACK, ports: Ports = Ports(), artifacts: str | None = None) -> list[Spec]:
    """The three services for `home`, bound to `host`; MLflow's artifacts at
    `artifacts_destination(home, artifacts)`."""
    check_exposure(host)
    home = Path(home).resolve()
    reach = LOOPBACK if host in WILDCARDS else host  # where clients on this machine connect
    shell = {k: v for k, v in os.environ.items() if k not in CLIENT_VARS}
    base = {**shell, **env.OFFLINE_AND_QUIET, "GRISTMILL_HOME": str(home)}
    prefect_url, mlflow_url = f"http://{reach}:{ports.prefect}", f"http://{reach}:{ports.mlflow}"
    prefect = Spec(
        name="prefect", url=prefect_url, health_url=f"{prefect_url}/api/health", host=reach,
        ports=(ports.prefect,), export={"PREFECT_API_URL": f"{prefect_url}/api"},
        argv=(_tool("prefect"), "server", "start", "--host", host, "--port", str(ports.prefect),
              "--analytics-off", "--no-prompt"),
        # The UI calls the API at PREFECT_UI_API_URL, which Prefect otherwise builds from the port
        # setting (4200), not from --port: on any other port the UI could not reach its server.
        env={**base, "PREFECT_HOME": str(env.prefect_home(home)), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "DO_NOT_TRACK": "1", "PREFECT_UI_API_URL": f"{prefect_url}/api"})
    # Served artifacts: clients upload through the server, which stores them under the home (for
    # experiments it creates; the pipeline's experiment may already name a file: location there).
    auth_args, auth_env = mlflow_auth(home, services_dir(home))
    mlflow = Spec(
        name="mlflow", url=mlflow_url, health_url=f"{mlflow_url}/health", host=reach,
        ports=(ports.mlflow,), export={"MLFLOW_TRACKING_URI": mlflow_url}, env={**base, **auth_env},
        argv=(_tool("mlflow"), "server", "--host", host, "--port", str(ports.mlflow),
              "--backend-store-uri", env.mlflow_store_uri(home),
              "--artifacts-destination", artifacts_destination(home, artifacts), "--workers", "2",
              *auth_args))
    ray_env = dict(base)
    node_ip: tuple[str, ...] = ()
    if env.is_loopback(host):  # see env.RAY_SINGLE_MACHINE: otherwise Ray binds the network IP
        ray_env[env.RAY_SINGLE_MACHINE] = "0"
        node_ip = ("--node-ip-address", LOOPBACK)
    elif host not in WILDCARDS:
        node_ip = ("--node-ip-address", host)
    dashboard_url = f"http://{reach}:{ports.ray_dashboard}"
    ray = Spec(
        name="ray", url=dashboard_url, health_url=f"{dashboard_url}/api/version", host=reach, env=ray_env,
        ports=(ports.ray, ports.ray_dashboard, ports.ray_client, ports.ray_agent),
        export={"RAY_ADDRESS": f"{reach}:{ports.ray}",
                **({env.RAY_SINGLE_MACHINE: "0"} if env.is_loopback(host) else {})},
        argv=(_tool("ray"), "start", "--head", "--block", "--disable-usage-stats", *node_ip,
              "--port", str(ports.ray), "--dashboard-host", host,
              "--dashboard-port", str(ports.ray_dashboard), "--ray-client-server-port", str(ports.ray_client),
              "--dashboard-agent-listen-port", str(ports.ray_agent), "--temp-dir", str(ray_temp_dir(home))))
    return [prefect, mlflow, ray]


# --- probes ---------------------------------------------------------------------------------

def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an http_proxy


def http_ok(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):  # URLError, HTTPError, timeouts, a reset connection
        return False


def healthy(record: Mapping) -> bool:
    """The service's own port accepts connections and its health URL answers 200."""
    return port_open(record["host"], record["ports"][0]) and http_ok(record["health_url"])


# --- records and processes ------------------------------------------------------------------

def _read(home: Path, name: str) -> dict | None:
    try:
        return json.loads((services_dir(home) / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _forget(home: Path, name: str) -> None:
    for suffix in (".pid", ".json"):
        (services_dir(home) / f"{name}{suffix}").unlink(missing_ok=True)


def _leader(record: Mapping | None) -> psutil.Process | None:
    """The recorded process if it still runs."""
    return processes.recorded(record["pid"], record["create_time"]) if record else None


def _recorded(record: Mapping, state: str, note: str = "") -> State:
    """A service whose process `record` describes."""
    return State(name=record["name"], state=state, pid=record["pid"], url=record["url"], note=note,
                 export=dict(record["export"]))


def _state(home: Path, name: str) -> State:
    record = _read(home, name)
    if record is None or _leader(record) is None:
        return State(name=name, state="stopped", url=record["url"] if record else None)
    ok = healthy(record)
    return replace(_recorded(record, "running" if ok else "starting"), healthy=ok)


# --- commands -------------------------------------------------------------------------------

def status(home: Path) -> list[State]:
    return [_state(home, name) for name in NAMES]


def _start(home: Path, spec: Spec) -> dict:
    folder = services_dir(home)
    log = (folder / f"{spec.name}.log").open("ab")
    # cwd=home: whatever a tool writes relative to its cwd stays under GRISTMILL_HOME.
    with log:
        proc = subprocess.Popen(list(spec.argv), env=dict(spec.env), cwd=home, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    record = {"name": spec.name, "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(),
              "argv": list(spec.argv), "host": spec.host, "ports": list(spec.ports),
              "health_url": spec.health_url, "url": spec.url, "export": dict(spec.export),
              "log": str(folder / f"{spec.name}.log")}
    (folder / f"{spec.name}.json").write_text(json.dumps(record, indent=1))
    (folder / f"{spec.name}.pid").write_text(f"{proc.pid}\n")
    return record


def up(home: Path, host: str = LOOPBACK, ports: Ports = Ports(), timeout_s: float = 180.0,
       names: tuple[str, ...] = NAMES, artifacts: str | None = None) -> list[State]:
    """Start each of the services `names` that is not already alive, then wait until all answer
    their health check. A service that exits or stays unhealthy past `timeout_s` is stopped and
    reported as failed (its log says why); the others keep running. `artifacts`: MLflow's
    artifact destination (`artifacts_destination`)."""
    ports.check()
    if "mlflow" in names:
        check_destination(artifacts_destination(home, artifacts))
    home = Path(home).resolve()
    services_dir(home).mkdir(parents=True, exist_ok=True)
    states: dict[str, State] = {}
    waiting: dict[str, dict] = {}
    with locked(home, STACK_LOCK):  # two `up`s at once would both start everything
        for spec in (s for s in specs(home, host, ports, artifacts) if s.name in names):
            record = _read(home, spec.name)
            if record is not None and _leader(record) is not None:
                waiting[spec.name] = record
                states[spec.name] = _recorded(record, "starting", "already running")
                continue
            _forget(home, spec.name)  # stale: its process is gone
            busy = [p for p in spec.ports if port_open(spec.host, p)]
            if busy:
                states[spec.name] = State(name=spec.name, state="failed", url=spec.url, note=(
                    f"port {', '.join(map(str, busy))} on {spec.host} is taken by a process gristmill "
                    f"did not start; choose others (gristmill up --help)"))
                continue
            # A new home's databases start as migrated templates (infra/schemas.py).
            if spec.name == "prefect":
                seed_prefect(env.prefect_home(home))
            if spec.name == "mlflow":
                seed_mlflow(home)
            waiting[spec.name] = record = _start(home, spec)
            states[spec.name] = _recorded(record, "starting", "started")
        _wait_healthy(home, states, waiting, timeout_s)
    return list(states.values())


def _wait_healthy(home: Path, states: dict[str, State], waiting: dict[str, dict], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while waiting:
        for name, record in list(waiting.items()):
            state = states[name]
            ours = state.note == "started"  # a failed service is stopped only if this call started it
            if healthy(record):
                state.state, state.healthy = "running", True
            elif _leader(record) is None:
                state.state, state.note = "failed", f"exited; see {record['log']}"
            elif time.monotonic() > deadline:
                state.state = "failed"
                state.note = f"not healthy after {timeout_s:.0f} s; see {record['log']}"
            else:
                continue
            del waiting[name]
            if state.state == "failed" and ours:
                processes.stop_sessions([(record["pid"], record["create_time"])], grace_s=2)
                _forget(home, name)
                state.pid = None
        time.sleep(0.5 if waiting else 0)


def down(home: Path, grace_s: float = STOP_GRACE_S) -> list[State]:
    """Stop every service `up` recorded in `home` (with all its processes) and forget it."""
    home = Path(home).resolve()
    with locked(home, STACK_LOCK) if home.is_dir() else contextlib.nullcontext():
        records = {name: _read(home, name) for name in NAMES}
        running = {name for name, record in records.items() if _leader(record) is not None}
        # A dead leader may have left children: every recorded session is stopped.
        processes.stop_sessions([(r["pid"], r["create_time"]) for r in records.values() if r], grace_s)
        for name in NAMES:
            _forget(home, name)
    return [State(name=name, state="stopped", url=record["url"] if record else None,
                  note=("not running" if record is None else f"stopped pid {record['pid']}" if name in running
                        else "stale pid file removed"))
            for name, record in records.items()]


def auth_note() -> str:
    """What clients need when `up` turned basic auth on (the secrets themselves are never printed)."""
    needs = [f"PREFECT_API_AUTH_STRING (the value of {PREFECT_AUTH})"] if os.environ.get(PREFECT_AUTH) else []
    needs += ["MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"] if os.environ.get(MLFLOW_AUTH) else []
    return f"\nbasic auth is on: clients also set {' and '.join(needs)}" if needs else ""


def exports(states: list[State]) -> str:
    """`export A=1 B=2` for the running services: what a shell sets to use them."""
    names = {k: v for s in states if s.state == "running" for k, v in s.export.items()}
    return "export " + " ".join(f"{k}={v}" for k, v in names.items()) if names else ""


def format_states(states: list[State]) -> str:
    rows = [f"{s.name:<8} {s.state:<8} {('pid ' + str(s.pid)) if s.pid else '-':<11} "
            f"{s.url or '-':<24} {'healthy' if s.healthy else 'not healthy' if s.pid else '-'}"
            f"{'  (' + s.note + ')' if s.note else ''}" for s in states]
    return "\n".join(rows)
