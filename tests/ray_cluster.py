"""A Ray cluster of two nodes on this machine, both on 127.0.0.1: a head, and a second node joined
to it (each with its own CPUs, temp dir and pinned ports), for tests of the multi-node paths; they
share one start through the session fixture `two_ray_nodes` (conftest.py).

The nodes share nothing but the network, as the nodes of a Kubernetes cluster do: the second node
runs in a mount namespace of its own (`unshare --mount --propagation private`) with an empty tmpfs
over every directory a driver-side run writes (`private_dirs`: the system temp dir, which holds the
tests' homes, Ray's and the runs' temp folders, and GRISTMILL_CACHE / GRISTMILL_HOME wherever they
are). What it still sees is what every node of a real cluster has in its image: the repository,
its virtual environment and the read-only shared data. Code that passes a worker a path only the
driver has therefore fails here as it would there; artifacts travel through the store's bucket.
Where `unshare` is refused (not root, no CAP_SYS_ADMIN) the fixture fails with the line it said.

Ray refuses a second node on one host while its single-machine switch keeps addresses on
loopback (infra/env.py), and without the switch it binds every interface; the second node is
therefore started through Ray's own CLI with the cluster switch on and loopback kept as it is.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from bench.harness.runs import SHARED_DATA
from gristmill.core import object_store
from gristmill.infra import env

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


ALIVE = "alive Ray nodes:"  # the count's own line: Ray may print warnings (a lagging heartbeat) after it


def _alive_nodes(address: str, environ: dict[str, str]) -> int:
    code = (f"import ray; ray.init(address=%r, log_to_driver=False); "
            f"print({ALIVE!r}, sum(n['Alive'] for n in ray.nodes()), flush=True)")
    done = subprocess.run([sys.executable, "-c", code % address], env=environ, capture_output=True, text=True,
                          timeout=120)
    counts = [line.removeprefix(ALIVE) for line in done.stdout.splitlines() if line.startswith(ALIVE)]
    return int(counts[-1]) if done.returncode == 0 and counts else 0


def private_dirs(*also: Path) -> list[Path]:
    """The directories a driver-side run writes, outermost only: the system temp dir, `also` (the
    tests' temp root) and GRISTMILL_CACHE / GRISTMILL_HOME when set. The second node gets an empty
    tmpfs over each, except over what every node of a real cluster has (the code, its Python, the
    shared data: a checkout cloned under the temp dir, as CI's may be): a directory holding one of
    those is hidden child by child instead (the children it has when the node starts)."""
    found = [Path(tempfile.gettempdir()), *also,
             *(Path(os.environ[var]) for var in ("GRISTMILL_CACHE", "GRISTMILL_HOME") if os.environ.get(var))]
    return _outermost([d for path in found for d in _hideable(path.resolve(), _KEPT)])


# What stays visible to the second node: the repository, the Python it runs, the shared data.
_REPO = Path(__file__).resolve().parents[1]
_KEPT = tuple(path.resolve() for path in (
    _REPO, Path(sys.prefix), Path(sys.base_prefix),
    SHARED_DATA))


def _hideable(path: Path, kept: tuple[Path, ...]) -> list[Path]:
    """`path` itself, or (where it holds a kept path) those of its subdirectories that hold none."""
    if any(path.is_relative_to(k) for k in kept):
        return []
    if not any(k.is_relative_to(path) for k in kept):
        return [path]
    children = sorted(child for child in path.iterdir() if child.is_dir() and not child.is_symlink())
    return [d for child in children for d in _hideable(child, kept)]


def _outermost(paths: list[Path]) -> list[Path]:
    ordered = sorted(set(paths), key=lambda path: len(path.parts))
    return [path for i, path in enumerate(ordered) if not any(path.is_relative_to(p) for p in ordered[:i])]


def _check_unshare() -> None:
    """Fail with unshare's own line where this machine refuses a private mount namespace."""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs",
                            "gristmill-probe", tempfile.gettempdir()], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        said = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        raise AssertionError(f"the second Ray node needs a private mount namespace: {said}")


def _private(argv: list[str], dirs: list[Path]) -> list[str]:
    """`argv` run in a mount namespace of its own with an empty tmpfs over each of `dirs`."""
    mounts = " && ".join(f"mount -t tmpfs gristmill-private {shlex.quote(str(d))}" for d in dirs)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *argv]


class TwoRayNodes(dict):
    """The environment a driver joins the cluster with (RAY_ADDRESS, the loopback switch), and the
    nodes' processes: the second node can be killed (its raylet, as a lost machine) and replaced by
    a fresh one, with an empty disk again, as Kubernetes replaces a pod."""

    def __init__(self, root: Path, private: list[Path], worker_ports: int = 21000):
        gcs, self.client = _free_ports(2)
        self.address = f"127.0.0.1:{gcs}"
        # the nodes' authentication too: a local Ray started in the test process leaves
        # RAY_AUTH_MODE=token in its environment, which a driver would then try on these nodes
        super().__init__({"RAY_ADDRESS": self.address, env.RAY_SINGLE_MACHINE: "0", "RAY_AUTH_MODE": "disabled"})
        self.root, self.private = root, private
        self.head_workers, self.second_workers = range(worker_ports, worker_ports + 100), \
            range(worker_ports + 100, worker_ports + 200)
        # The head's GCS marks a node dead after 3 missed health checks a second apart (Ray's
        # defaults, 5 missed 3 s apart, left a lost node counted alive for about 17 s, and Ray
        # Train's restart waited as long); a node must be unresponsive for 3 s or more.
        # The nodes start without the object stores' variables, whichever emulator fixtures this
        # session started first: a worker gets its endpoint and credentials from the driver, as on
        # a cluster started before the job (infra/ray_engine.py PASSED_VARS).
        kept = {k: v for k, v in os.environ.items() if not k.startswith(object_store.CLIENT_VARIABLES)}
        self.environ = {**kept, **self, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
                        "RAY_USAGE_STATS_ENABLED": "0",
                        "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
        self.head: subprocess.Popen | None = None
        self.second: subprocess.Popen | None = None
        self.started = 0  # second nodes started: each gets a temp dir of its own

    def start_head(self) -> None:
        head_env = {k: v for k, v in self.environ.items() if k != "RAY_ADDRESS"}
        ray_cli = str(Path(sys.executable).with_name("ray"))
        self.head = subprocess.Popen(
            [ray_cli, "start", "--head", "--port", self.address.rsplit(":", 1)[1],
             "--ray-client-server-port", str(self.client), "--include-dashboard", "false",
             *_node_args(env.short_path(self.root / "head", 40), self.head_workers)],
            env=head_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def start_second(self) -> None:
        """A second node on a private disk; returns once the cluster has two alive nodes."""
        self.started += 1
        temp = env.short_path(self.root / f"second-{self.started}", 40)  # under the tmpfs: its own
        said = self.root / f"second-{self.started}.err"
        with said.open("w") as err:
            self.second = subprocess.Popen(
                _private([sys.executable, "-c", SECOND_NODE, "start", "--address", self.address,
                          *_node_args(temp, self.second_workers)], self.private),
                env=self.environ, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        self.wait_for(2, said)

    def wait_for(self, count: int, said: Path | None = None) -> None:
        deadline = time.monotonic() + 120
        while self.alive() < count:
            assert time.monotonic() < deadline, f"{count} Ray nodes did not come up within 120 s"
            for node in (self.head, self.second):
                if node is not None and node.poll() is not None:
                    last = (said.read_text().strip().splitlines() or [""])[-1] if said else ""
                    raise AssertionError(f"a Ray node exited while starting: {last}")
            time.sleep(1)

    def alive(self) -> int:
        return _alive_nodes(self.address, self.environ)

    def second_raylet(self) -> psutil.Process:
        """The second node's raylet (a child of its `ray start`)."""
        assert self.second is not None
        return next(p for p in psutil.Process(self.second.pid).children(recursive=True) if p.name() == "raylet")

    def replace_second(self) -> None:
        """A fresh second node (an empty disk again) for one that was lost: once the head has seen
        it go, as Kubernetes starts a new pod for a lost one."""
        deadline = time.monotonic() + 120
        while self.alive() > 1:
            assert time.monotonic() < deadline, "the head still counts the lost node alive after 120 s"
            time.sleep(1)
        self.stop_second()  # what is left of it
        self.start_second()

    def second_is_up(self) -> bool:
        """Whether the second node's `ray start` and its raylet still run."""
        if self.second is None or self.second.poll() is not None:
            return False
        children = psutil.Process(self.second.pid).children(recursive=True)
        return any(p.name() == "raylet" and p.status() != psutil.STATUS_ZOMBIE for p in children)

    def restore_second(self) -> None:
        """A fresh second node where the last one is gone (a test that lost it and failed), so
        that one failure does not fail every test after it."""
        if not self.second_is_up():
            self.replace_second()

    def stop_second(self) -> None:
        _stop(self.second)
        self.second = None

    def stop(self) -> None:
        self.stop_second()
        _stop(self.head)


def _stop(node: subprocess.Popen | None) -> None:
    """A node's processes, by its session (never `ray stop`: that stops every Ray)."""
    if node is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGTERM)
    try:
        node.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait(30)


@contextlib.contextmanager
def two_ray_nodes(root: Path, private: list[Path] | None = None, worker_ports: int = 21000) -> Iterator[TwoRayNodes]:
    """Start the head and a second node on a private disk (`private`: the directories it gets an
    empty tmpfs over, `private_dirs(root)` by default), their workers on 200 ports from
    `worker_ports`; yields them, the environment a driver joins them with. Each node is stopped by
    its session, the second first."""
    _check_unshare()
    root.mkdir(parents=True, exist_ok=True)
    cluster = TwoRayNodes(root, private if private is not None else private_dirs(root), worker_ports)
    try:
        cluster.start_head()
        cluster.start_second()
        yield cluster
    finally:
        cluster.stop()
