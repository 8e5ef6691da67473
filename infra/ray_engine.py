"""Ray as the data-processing engine: the only module that calls `ray.init`.

`RayEngine.map(fn, items)` runs `fn` over `items` on a pool of Ray actors and returns results in
input order, so a stage's output does not depend on the worker count. It joins the cluster named
by `RAY_ADDRESS` when set (e.g. KubeRay), else starts Ray locally on first use; a map of a single
item before that runs in this process (a local Ray would only add its start-up). The actors live
from the first map to `shutdown()`, so a stage that maps several times (collect: units, then
MinHash signatures and buckets) pays their start-up and warm caches (spaCy, fastText) once.
The actors are placed on a cluster's nodes in turn (Ray would otherwise pack them onto one), and the
engine counts which node ran each unit: `units_per_node`, logged after each map and kept in the
stage's manifest stats by the flow layer.
A worker that dies (OOM, a kill) is restarted and its call retried: the mapped functions are
pure, so a retry gives the same result. A local Ray listens on 127.0.0.1 only (its head also
runs Ray's API server, `dashboard.py`, even without the dashboard: it serves Ray's state API,
not the web UI, and it too binds 127.0.0.1). A stage followed by another data stage of the same
run leaves its local Ray running (`shutdown(keep_local=True)`) and the next stage's engine takes it
over, so a run starts Ray once for collect and tokenize; `release_local` stops one that no stage
took over. A local Ray keeps its session folder (logs, sockets)
in a temp root of its own, not in the shared /tmp/ray: a new folder inside the supervisor's scratch
folder (infra/supervisor.py) when there is one, which the supervisor removes however the run
stops, else in the system temp folder. `shutdown` removes it, so runs do not pile them up.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from gristmill.core import object_store
from gristmill.core.stage import SerialEngine, map_name, map_progress
from gristmill.infra import env
from gristmill.infra.supervisor import remove_tree, scratch_dir

env.keep_ray_on_loopback()  # before Ray is imported: it reads the switch then
import ray  # noqa: E402
from ray.util import ActorPool  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("gristmill.ray")
MAX_RESTARTS = 3  # of a worker that died, each time retrying the call it was running
# What a worker on another node needs of the driver's environment: the store, the shared data, the
# offline switches, every object store's endpoint and credentials (a joined cluster's nodes were
# started without them; a local Ray's workers inherit them anyway).
PASSED_VARS = ("GRISTMILL_", "HF_", "TOKENIZERS_", "OMP_NUM_THREADS", "PYTHONPATH", *object_store.CLIENT_VARIABLES)


def driver_env() -> dict[str, str]:
    """This process's variables that its workers on the cluster's nodes get (PASSED_VARS)."""
    return {k: v for k, v in os.environ.items() if k.startswith(PASSED_VARS)}
# Ray's sockets live at <temp root>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store, up to
# 64 characters below the root, and a Unix socket's path may not exceed 107.
TEMP_ROOT_MAX_CHARS = 40
# The temp root of the local Ray a stage left running for the next stage of its run (None: none is).
_kept_root: Path | None = None


@ray.remote
class _Worker:
    """A long-lived worker process; functions arrive pickled with each call."""

    def __init__(self) -> None:
        # asked again when a worker that died is restarted, possibly on another node
        self.node_id = ray.get_runtime_context().get_node_id()

    def call(self, fn: Callable[[T], R], item: T) -> R:
        return fn(item)

    def call_at(self, fn: Callable[[T], R], index: int, item: T) -> tuple[int, str, int, R]:
        """(index, the node that ran it, the object-store retries it took, result)."""
        retried = object_store.retries()
        result = fn(item)
        return index, self.node_id, object_store.retries() - retried, result


class RayEngine:
    def __init__(self, num_workers: int, runtime_env: dict | None = None,
                 worker_dirs: Callable[[Path], str] | None = None):
        """`runtime_env`: Ray's, for every task and actor of this driver (e.g. environment variables);
        `worker_dirs`: where workers write what belongs in a stage folder of this machine, when
        that is not the folder itself (core.stage.worker_dir)."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.runtime_env = runtime_env
        self.worker_dirs = worker_dirs
        self._started_here = False
        self._temp_root: Path | None = None  # a local Ray's, when this engine started it
        self._actors: list = []
        # map name (the mapped function's) -> Ray node id -> units that node ran, over this engine's maps
        self.units_per_node: dict[str, Counter[str]] = {}
        self.store_retries = 0  # the workers' object-store retries over this engine's maps (core/object_store.py)

    def start(self) -> None:
        """Join the cluster named by RAY_ADDRESS, take over the local Ray the previous stage left
        running, or start a local Ray; idempotent."""
        global _kept_root
        address = os.environ.get("RAY_ADDRESS")
        if _kept_root is not None and ray.cluster_resources().get("CPU", 0) < self.num_workers:
            release_local()  # started for fewer workers than this stage's: start one that fits
        if ray.is_initialized():
            if _kept_root is not None:  # now this engine's to stop or pass on
                self._temp_root, self._started_here, _kept_root = _kept_root, True, None
            return
        if address:
            ray.init(address=address, log_to_driver=False, runtime_env=self.runtime_env or {"env_vars": driver_env()})
        else:
            self._temp_root = init_local(self.num_workers, self.runtime_env)
            self._started_here = True
        log.info("ray: %s, %s workers", address or "local", self.num_workers)

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        if not items:
            return []
        if len(items) == 1 and not self._actors and not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
            # One call has nothing to run beside it: starting a local Ray for it (docs/benchmarks.md;
            # e.g. a small corpus's one tokenize shard) costs more than the call.
            return SerialEngine().map(fn, items)
        self.start()
        if not self._actors:
            self._actors = start_workers(self.num_workers)
        pool = ActorPool(self._actors[: len(items)])
        results: list = [None] * len(items)
        nodes: Counter[str] = Counter()
        # Units are counted as they finish, in whatever order; results are put back in input order.
        with map_progress(fn, len(items)) as progress:
            for index, node, retried, result in pool.map_unordered(lambda actor, job: actor.call_at.remote(fn, *job),
                                                          list(enumerate(items))):
                results[index] = result
                nodes[node] += 1
                self.store_retries += retried
                progress.advance(1)
        self.units_per_node.setdefault(map_name(fn), Counter()).update(nodes)
        log.info("%s: %d units, per Ray node: %s", map_name(fn), len(items),
                 ", ".join(f"{node[:8]} {n}" for node, n in sorted(nodes.items())))
        return results

    def shutdown(self, keep_local: bool = False) -> None:
        """Stop the actors, and the local Ray instance this engine started or took over, unless
        `keep_local`: then the next engine to start takes it over (a joined cluster is left running)."""
        global _kept_root
        if ray.is_initialized():  # another engine may have stopped the Ray it joined
            for actor in self._actors:
                ray.kill(actor)
        self._actors = []
        if self._started_here:
            if keep_local:
                _kept_root = self._temp_root
            else:
                shutdown_local(self._temp_root)
            self._started_here, self._temp_root = False, None


def release_local() -> None:
    """Stop the local Ray a stage left running for a next one that did not take it over."""
    global _kept_root
    if _kept_root is not None:
        root, _kept_root = _kept_root, None
        shutdown_local(root)


def start_workers(count: int) -> list:
    """`count` worker actors, placed on the cluster's nodes in turn."""
    return [_Worker.options(max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS,
                            scheduling_strategy=placement).remote()
            for placement in _placements(count)]


def _local_cpus(num_workers: int) -> int:
    return max(num_workers, os.cpu_count() or 1)


def init_local(num_workers: int, runtime_env: dict | None = None) -> Path:
    """Start a local Ray with room for `num_workers` workers, in a new temp root; that root. A
    start that fails or is interrupted (Ctrl-C) stops what it started and removes the root."""
    root = new_temp_root()
    try:
        ray.init(num_cpus=_local_cpus(num_workers), include_dashboard=False, log_to_driver=False,
                 configure_logging=False, runtime_env=runtime_env, _temp_dir=str(root))
    except BaseException:
        shutdown_local(root)
        raise
    return root


def new_temp_root() -> Path:
    """A new folder for a local Ray's temp root (`ray.init`'s documented `_temp_dir`: its session
    folder, logs and sockets): in the supervisor's scratch folder, or where that path leaves no
    room for Ray's sockets, in the system temp folder (else /tmp)."""
    scratch = scratch_dir()
    if scratch is not None and len(str(scratch)) + len("/ray-12345678") <= TEMP_ROOT_MAX_CHARS:
        return Path(tempfile.mkdtemp(prefix="ray-", dir=scratch))
    system = tempfile.gettempdir()
    short = system if len(system) + len("/gristmill-ray-12345678") <= TEMP_ROOT_MAX_CHARS else "/tmp"
    return Path(tempfile.mkdtemp(prefix="gristmill-ray-", dir=short))


def shutdown_local(temp_root: Path | None) -> None:
    """Stop the local Ray and remove its temp root (session folder, logs, sockets), so runs do
    not pile them up in the temp folder."""
    ray.shutdown()
    if temp_root is not None:
        remove_tree(temp_root)


def _placements(count: int) -> list[str | NodeAffinitySchedulingStrategy]:
    """Ray scheduling strategies for `count` actors: on a cluster of several nodes, its nodes with
    CPUs in turn, so every node works. Ray's default packs the actors onto one node, and its SPREAD
    is best effort: with a head and a second node it put both actors on one node in one map of
    three. Soft: a node that is gone or cannot take its actor leaves it (and its restarts) to Ray.
    On one node: Ray's default, as before."""
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0]
    if len(nodes) < 2:
        return ["DEFAULT"] * count
    return [NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=True) for i in range(count)]
