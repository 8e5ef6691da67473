"""Ray as the data-processing engine: the only module that calls `ray.init`.

`RayEngine.map(fn, items)` runs `fn` over `items` on a pool of Ray actors and returns results in
input order, so a stage's output does not depend on the worker count. It joins the cluster named
by `RAY_ADDRESS` when set (e.g. KubeRay), else starts Ray locally on first use. The actors live
from the first map to `shutdown()`, so a stage that maps several times (collect: units, then
MinHash signatures and buckets) pays their start-up and warm caches (spaCy, fastText) once.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence, TypeVar

import ray
from ray.util import ActorPool

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("gristmill.ray")


@ray.remote
class _Worker:
    """A long-lived worker process; functions arrive pickled with each call."""

    def call(self, fn: Callable[[T], R], item: T) -> R:
        return fn(item)


class RayEngine:
    def __init__(self, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._started_here = False
        self._actors: list = []

    def start(self) -> None:
        """Join the cluster named by RAY_ADDRESS, or start a local Ray; idempotent."""
        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=max(self.num_workers, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
            self._started_here = True
        log.info("ray: %s, %s workers", address or "local", self.num_workers)

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        if not items:
            return []
        self.start()
        if not self._actors:
            self._actors = [_Worker.remote() for _ in range(self.num_workers)]
        pool = ActorPool(self._actors[: len(items)])
        return list(pool.map(lambda actor, item: actor.call.remote(fn, item), items))

    def shutdown(self) -> None:
        """Stop the actors, and the local Ray instance this engine started (a joined cluster is
        left running)."""
        if ray.is_initialized():  # another engine may have stopped the Ray it joined
            for actor in self._actors:
                ray.kill(actor)
        self._actors = []
        if self._started_here and ray.is_initialized():
            ray.shutdown()
            self._started_here = False
