"""The warm runner's protocol and the supervisor's side of it. The runner (flows/runner.py) is a
process `gristmill up` keeps with the run's imports done, which `gristmill run` forks its pipeline
child from instead of starting a fresh interpreter.

A fully reused run against a standing stack spends most of its time importing Prefect and MLflow
(~3.5 s of ~8 s on a quiet 2-core machine: MLflow's `__init__` alone imports pandas, FastAPI and
its GenAI modules). The runner imports them once, creates no thread, client or connection, and
then waits on a Unix socket in the home. For each run the supervisor sends its arguments, its
environment, its working directory and its terminal (stdin, stdout, stderr, passed as file
descriptors); the runner forks, and the fork becomes the pipeline child: a session of its own,
the supervisor's terminal and environment, `flows.cli.main(argv)`. The runner reports the
fork's pid at once and its exit status when it ends, so the supervisor treats it like a child
it started itself (signals forwarded, the whole process tree stopped on Ctrl-C).

A fork is only as right as what the runner imported, so the runner refuses (and the supervisor
starts a fresh interpreter as before) when the run would see something else:
- a variable read at import differs (PREFECT_*, MLFLOW_*, PYTHON*, DO_NOT_TRACK),
  compared after both sides take gristmill's defaults (`env.apply_defaults`);
- another Python or another gristmill checkout asks;
- gristmill's source files or the installed packages changed since the runner started; the
  runner then starts itself again (same pid) as soon as no run it forked is still going.
`GRISTMILL_WARM=0` in the environment skips the runner.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

from infra import env

SOCKET_NAME = "runner.sock"
IMPORT_PREFIXES = ("PREFECT_", "MLFLOW_", "PYTHON", "DO_NOT_TRACK")
CODE_ROOT = Path(__file__).resolve().parents[1]  # the checkout the runner imports gristmill from
PACKAGES = ("core", "flows", "infra", "model", "tasks")  # gristmill's own source folders
SOCKET_MAX_CHARS = 100  # a Unix socket path may not exceed 107 bytes
TERMINAL = (0, 1, 2)


def socket_path(home: Path) -> Path:
    return env.short_path(Path(home).resolve() / "services" / SOCKET_NAME, SOCKET_MAX_CHARS)


def import_view(environ: Mapping[str, str], home: Path) -> dict[str, str]:
    """The variables a process sees at import time once gristmill's defaults are applied."""
    configured = dict(environ)
    env.apply_defaults(configured, Path(home).resolve())
    return {k: v for k, v in sorted(configured.items()) if k.startswith(IMPORT_PREFIXES)}


def code_state() -> tuple:
    """What invalidates the runner's imports: gristmill's loaded source files and the package
    folders they were imported from (pip adding or removing a package changes the folder)."""
    ours = tuple(str(CODE_ROOT / package) + os.sep for package in PACKAGES)
    files = sorted(str(m.__file__) for m in list(sys.modules.values())
                   if str(getattr(m, "__file__", None)).startswith(ours))
    folders = sorted({p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)})
    return tuple((path, os.stat(path).st_mtime_ns) for path in [*files, *folders])


def send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def receive_line(conn: socket.socket, first: bytes = b"") -> dict[str, Any]:
    data = first
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        data += chunk
    return json.loads(data)


# --- the supervisor's side --------------------------------------------------------------------

class WarmChild:
    """A run forked by the runner, driven like a `subprocess.Popen` of the supervisor's own:
    `pid`, `poll`, `wait(timeout)`, `send_signal`, `returncode` (negative: killed by a signal)."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid, self.returncode = conn, pid, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if not select.select([self.conn], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("gristmill run (warm)", timeout or 0)
        try:
            self.conn.settimeout(10)  # the runner writes the whole line at once
            self.returncode = int(receive_line(self.conn)["exit"])
        except (OSError, KeyError, ValueError):
            # The runner stopped (`gristmill down`) before the run ended: its status is lost.
            import psutil

            try:
                psutil.Process(self.pid).wait()
            except psutil.NoSuchProcess:
                pass
            print("gristmill: the warm runner stopped during the run; its exit status is unknown",
                  file=sys.stderr)
            self.returncode = 1
        self.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass


def fork_run(argv: list[str], environ: Mapping[str, str]) -> WarmChild | None:
    """Ask the home's runner to fork the pipeline child for `gristmill <argv>`; None when there
    is no runner, it refuses, or it does not answer (the caller then starts a fresh process)."""
    if environ.get("GRISTMILL_WARM") == "0":
        return None
    home = Path(environ.get("GRISTMILL_HOME", env.DEFAULT_HOME)).resolve()
    path = socket_path(home)
    if not path.exists():
        return None
    request = {"argv": list(argv), "env": {**environ, "GRISTMILL_HOME": str(home)},
               "cwd": os.getcwd(), "executable": sys.executable, "code": str(CODE_ROOT)}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(10)
        conn.connect(str(path))
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], list(TERMINAL))
        reply = receive_line(conn)
    except (OSError, ValueError):
        conn.close()
        return None
    if "pid" not in reply:
        conn.close()
        return None
    return WarmChild(conn, int(reply["pid"]))


def ping(path: str | Path, timeout_s: float = 3.0) -> bool:
    """The runner at `path` accepts a request and answers (its health check)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(str(path))
            send(conn, {"ping": True})
            return bool(receive_line(conn).get("ok"))
    except (OSError, ValueError):
        return False
