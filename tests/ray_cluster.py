"""A Ray cluster of two nodes on this machine, both on 127.0.0.1: a head, and a second node joined
to it (each with its own CPUs, temp dir and pinned ports), for tests of the multi-node paths; they
share one start through the session fixture `two_ray_nodes` (conftest.py).

Ray refuses a second node on one host while its single-machine switch keeps addresses on
loopback (infra/env.py), and without the switch it binds every interface; the second node is
therefore started through Ray's own CLI with the cluster switch on and loopback kept as it is.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from infra import env

SECOND_NODE = ("import ray._private.ray_constants as constants, ray._private.services as services; "
               "constants.ENABLE_RAY_CLUSTER = True; services.resolve_ip_for_localhost = lambda host: host; "
               "from ray.scripts.scripts import main; main()")
PORTS_EACH = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def _node_args(temp_dir: Path, workers: range) -> list[str]:
    pinned = [arg for flag, port in zip(PORTS_EACH, _free_ports(len(PORTS_EACH))) for arg in (flag, str(port))]
    return ["--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
            "--temp-dir", str(temp_dir), "--min-worker-port", str(workers.start),
            "--max-worker-port", str(workers.stop - 1), *pinned]


def _alive_nodes(address: str, environ: dict[str, str]) -> int:
    code = "import ray; ray.init(address=%r, log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
    done = subprocess.run([sys.executable, "-c", code % address], env=environ, capture_output=True, text=True,
                          timeout=120)
    return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0


@contextlib.contextmanager
def two_ray_nodes(root: Path) -> Iterator[dict[str, str]]:
    """Start the two nodes; yields the environment a driver joins them with (RAY_ADDRESS, the
    loopback switch). Each node is stopped by its pid (never `ray stop`: that stops every Ray)."""
    gcs, client = _free_ports(2)
    address = f"127.0.0.1:{gcs}"
    environ = {**os.environ, "RAY_ADDRESS": address, env.RAY_SINGLE_MACHINE: "0",
               "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_AUTH_MODE": "disabled"}
    head_env = {k: v for k, v in environ.items() if k != "RAY_ADDRESS"}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(subprocess.Popen(
            [ray_cli, "start", "--head", "--port", str(gcs), "--ray-client-server-port", str(client),
             "--include-dashboard", "false", *_node_args(env.short_path(root / "head", 40), range(21000, 21100))],
            env=head_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        nodes.append(subprocess.Popen(
            [sys.executable, "-c", SECOND_NODE, "start", "--address", address,
             *_node_args(env.short_path(root / "second", 40), range(21100, 21200))],
            env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 120
        while _alive_nodes(address, environ) < 2:
            assert time.monotonic() < deadline, "the two Ray nodes did not come up within 120 s"
            assert all(node.poll() is None for node in nodes), "a Ray node exited while starting"
            time.sleep(1)
        yield {"RAY_ADDRESS": address, env.RAY_SINGLE_MACHINE: "0"}
    finally:
        for node in reversed(nodes):  # the second node first
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
