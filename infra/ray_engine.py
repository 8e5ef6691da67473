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
not the web UI, and it too binds 127.0.0.1). A local Ray's session directory
(logs, sockets) is removed at shutdown, so runs do not pile them up in the system temp folder.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from core.stage import SerialEngine, load, map_name, map_progress
from infra import env

env.keep_ray_on_loopback()  # before Ray is imported: it reads the switch then
import ray  # noqa: E402
from ray.util import ActorPool  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("gristmill.ray")
MAX_RESTARTS = 3  # of a worker that died, each time retrying the call it was running


@ray.remote
class _Worker:
    """A long-lived worker process; functions arrive pickled with each call."""

    def __init__(self) -> None:
        # asked again when a worker that died is restarted, possibly on another node
        self.node_id = ray.get_runtime_context().get_node_id()

    def call(self, fn: Callable[[T], R], item: T) -> R:
        return fn(item)

    def warm(self, dotted: str) -> None:
        """Call the function at "module.function" (a stage's `warm_worker`: imports, models)."""
        try:
            load(dotted)()
        except Exception:  # the first unit meets the same error, and reports it
            log.debug("warming %s failed", dotted, exc_info=True)

    def call_at(self, fn: Callable[[T], R], index: int, item: T) -> tuple[int, str, R]:
        """(index, the node that ran it, result)."""
        return index, self.node_id, fn(item)


class RayEngine:
    def __init__(self, num_workers: int, runtime_env: dict | None = None,
                 worker_dirs: Callable[[Path], str] | None = None, early: Any = None):
        """`runtime_env`: Ray's, for every task and actor of this driver (e.g. environment variables);
        `worker_dirs`: where workers write what belongs in a stage folder of this machine, when
        that is not the folder itself (core.stage.worker_dir); `early`: a local Ray started ahead
        of need (infra/ray_start.py's EarlyRay), used when it fits, else stopped."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.runtime_env = runtime_env
        self.worker_dirs = worker_dirs
        self._started_here = False
        self._session_dir: str | None = None
        self._early_pending = early
        self._early: Any = None  # the early Ray this engine works on
        self._actors: list = []
        # map name (the mapped function's) -> Ray node id -> units that node ran, over this engine's maps
        self.units_per_node: dict[str, Counter[str]] = {}

    def start(self) -> None:
        """Join the cluster named by RAY_ADDRESS, or take the local Ray started early, or start a
        local Ray; idempotent."""
        address = os.environ.get("RAY_ADDRESS")
        if (early := self._early_pending) is not None:
            self._early_pending = None
            early.wait()
            if address or self.runtime_env or _local_cpus(early.num_workers) != _local_cpus(self.num_workers):
                early.stop()  # started for other workers or settings than these
            else:
                self._early, self._session_dir, self._started_here = early, early.session_dir, True
                if len(early.workers) == self.num_workers:  # started, and warming, beside the run's start
                    self._actors = early.workers
                else:
                    for actor in early.workers:
                        ray.kill(actor)
                log.info("ray: local, %s workers (started early)", self.num_workers)
                return
        if ray.is_initialized():
            return
        if address:
            ray.init(address=address, log_to_driver=False, runtime_env=self.runtime_env)
        else:
            self._session_dir = init_local(self.num_workers, self.runtime_env)
            self._started_here = True
        log.info("ray: %s, %s workers", address or "local", self.num_workers)

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        if not items:
            return []
        if len(items) == 1 and not self._actors and not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
            # One call has nothing to run beside it: starting a local Ray for it (docs/benchmarks.md;
            # e.g. the tiny preset's one tokenize shard) costs more than the call.
            return SerialEngine().map(fn, items)
        self.start()
        if not self._actors:
            self._actors = start_workers(self.num_workers)
        pool = ActorPool(self._actors[: len(items)])
        results: list = [None] * len(items)
        nodes: Counter[str] = Counter()
        # Units are counted as they finish, in whatever order; results are put back in input order.
        with map_progress(fn, len(items)) as progress:
            for index, node, result in pool.map_unordered(lambda actor, job: actor.call_at.remote(fn, *job),
                                                          list(enumerate(items))):
                results[index] = result
                nodes[node] += 1
                progress.advance(1)
        self.units_per_node.setdefault(map_name(fn), Counter()).update(nodes)
        log.info("%s: %d units, per Ray node: %s", map_name(fn), len(items),
                 ", ".join(f"{node[:8]} {n}" for node, n in sorted(nodes.items())))
        return results

    def shutdown(self) -> None:
        """Stop the actors, and the local Ray instance this engine started (a joined cluster is
        left running)."""
        if ray.is_initialized():  # another engine may have stopped the Ray it joined
            for actor in self._actors:
                ray.kill(actor)
        self._actors = []
        if self._started_here and ray.is_initialized():
            shutdown_local(self._session_dir)
            self._started_here = False
        if self._early is not None:
            self._early.release()
            self._early = None
        if self._early_pending is not None:  # never started: the early Ray goes unused
            self._early_pending.stop()
            self._early_pending = None


def start_workers(count: int, warm: str | None = None) -> list:
    """`count` worker actors, placed on the cluster's nodes in turn; each first calls `warm`
    ("module.function"), when given, before any call sent to it later."""
    actors = [_Worker.options(max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS,
                              scheduling_strategy=placement).remote()
              for placement in _placements(count)]
    if warm:
        for actor in actors:
            actor.warm.remote(warm)
    return actors


def _local_cpus(num_workers: int) -> int:
    return max(num_workers, os.cpu_count() or 1)


def init_local(num_workers: int, runtime_env: dict | None = None) -> str | None:
    """Start a local Ray with room for `num_workers` workers; its session directory."""
    ray.init(num_cpus=_local_cpus(num_workers), include_dashboard=False, log_to_driver=False,
             configure_logging=False, runtime_env=runtime_env)
    return _session_dir()


def shutdown_local(session_dir: str | None) -> None:
    """Stop the local Ray and remove its session directory (logs, sockets), so runs do not pile
    them up in the system temp folder."""
    ray.shutdown()
    if session_dir:
        shutil.rmtree(session_dir, ignore_errors=True)


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


def _session_dir() -> str | None:
    """The local Ray's session directory (Ray has no public accessor for it)."""
    node = getattr(ray._private.worker, "_global_node", None)
    return node.get_session_dir_path() if node is not None else None
