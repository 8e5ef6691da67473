"""The Ray engine: results in input order whatever the worker count, a worker killed mid-call is
restarted and the call retried, the node of each unit counted, and a local Ray leaves no session
directory behind (also one started early, infra/ray_start.py)."""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

from core import progress
from infra.ray_engine import RayEngine


def test_a_killed_worker_is_restarted_its_call_retried_and_the_session_dir_removed(tmp_path, monkeypatch, caplog):
    """... and the map reports its units as they finish (core/progress.py), each once."""
    def square_killing_once(n: int) -> int:  # nested, so Ray ships it by value to the workers
        """The first call for 3 kills its own worker process, as an OOM killer would."""
        marker = tmp_path / f"killed-{n}"
        if n == 3 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return n * n

    seen = []
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)  # every unit reported, to see each
    engine = RayEngine(num_workers=2)
    try:
        with caplog.at_level(logging.INFO, "gristmill.map"), progress.scope("collect", SimpleNamespace(
                update=seen.append)):
            assert engine.map(square_killing_once, list(range(8))) == [n * n for n in range(8)]
        assert [(s.done, s.total) for s in seen] == [(n, 8) for n in range(9)] + [(8, 8)]
        assert seen[-1].final and seen[-1].what == "collect: square_killing_once" and seen[-1].unit == "unit"
        assert [r.getMessage().split(",")[0] for r in caplog.records if r.name == "gristmill.map"] == [
            "collect: square_killing_once 8/8 units (100%)"]
        assert (tmp_path / "killed-3").exists()  # the fault did happen
        placed = engine.units_per_node["square_killing_once"]
        assert len(placed) == 1 and sum(placed.values()) == 8, placed  # a retried unit counts once
        session = engine._session_dir
        assert session and Path(session).is_dir()
    finally:
        engine.shutdown()
    assert not Path(session).exists()


def test_a_local_ray_listens_on_loopback_only():
    """Every socket Ray's processes listen on (GCS, raylet, agents, workers, its API server) is
    on 127.0.0.1: without the single-machine switch they listen on every interface."""
    import psutil

    from infra.processes import process_tree

    engine = RayEngine(num_workers=2)
    try:
        assert engine.map(abs, [-1, -2]) == [1, 2]
        listening = set()
        for proc in process_tree(os.getpid()):
            try:
                listening |= {(c.laddr.ip, c.laddr.port, proc.name()) for c in proc.net_connections("inet")
                              if c.status == psutil.CONN_LISTEN}
            except psutil.Error:  # exited meanwhile
                continue
    finally:
        engine.shutdown()
    assert len({name for *_, name in listening}) >= 3, listening  # gcs_server, raylet, workers...
    assert {ip for ip, *_ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening


def test_a_single_call_runs_here_without_starting_ray(monkeypatch):
    """One item has nothing to run beside it: no local Ray is started for it (its start-up is
    seconds); two items start Ray as before."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    engine = RayEngine(num_workers=2)
    try:
        assert engine.map(lambda _: os.getpid(), [None]) == [os.getpid()]
        assert not ray.is_initialized() and engine._session_dir is None
        assert engine.map(abs, [-1, -2]) == [1, 2] and ray.is_initialized()
    finally:
        engine.shutdown()


def _ray_start_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "gristmill-ray-start"]


def test_a_ray_started_early_is_taken_by_the_engine_and_ends_with_it(monkeypatch, caplog):
    """`gristmill run` starts a local Ray on a thread while it starts its services
    (infra/ray_start.py), and the flow hands it to the stage's engine, which works on it; the
    engine's shutdown stops it, removes its session directory and ends the thread (Ray's processes
    die with the thread that started them, so the thread lives exactly as long as that Ray)."""
    import ray

    from infra import ray_start

    def warmed(_) -> tuple[int, int]:  # nested, so Ray ships it by value to the workers
        """What the collect stage's warm_worker loaded in this worker before any unit ran."""
        from tasks.collect import langid, rules

        return rules._spacy.cache_info().currsize, langid.load_model.cache_info().currsize

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_start.start_early(2, warm="tasks.collect.stage.warm_worker")
    assert len(_ray_start_threads()) == 1
    early = ray_start.take_early()
    engine = RayEngine(num_workers=2, early=early)
    try:
        with caplog.at_level(logging.INFO, "gristmill.ray"):
            assert engine.map(warmed, [0, 1]) == [(1, 1), (1, 1)]  # in each of the two workers
        assert "ray: local, 2 workers (started early)" in caplog.text
        assert engine._actors == early.workers and len(early.workers) == 2
        assert engine.map(abs, [-1, -2, -3]) == [1, 2, 3]
        session = engine._session_dir
        assert session and Path(session).is_dir() and len(_ray_start_threads()) == 1
    finally:
        engine.shutdown()
    assert not ray.is_initialized() and not Path(session).exists() and not _ray_start_threads()


def test_a_warm_up_that_fails_leaves_the_workers_to_their_units(monkeypatch):
    """The error of a stage's warm_worker is the units' to meet and report: the map runs."""
    from infra import ray_start

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_start.start_early(2, warm="no_such_module.warm")
    engine = RayEngine(num_workers=2, early=ray_start.take_early())
    try:
        assert engine.map(abs, [-1, -2, -3]) == [1, 2, 3] and len(engine._actors) == 2
    finally:
        engine.shutdown()


def test_an_early_ray_no_engine_takes_is_stopped_and_one_for_other_workers_replaced(monkeypatch):
    """The stage that was to use the early Ray did not compute: stop_early stops it and its
    thread. An engine with more workers than the early Ray has CPUs for starts its own."""
    import ray

    from infra import ray_start

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_start.start_early(1, warm="no_such_module.warm")
    ray_start.stop_early()
    assert not ray.is_initialized() and not _ray_start_threads()
    ray_start.stop_early()  # none pending: nothing to do

    workers = (os.cpu_count() or 1) + 1
    ray_start.start_early(1)
    engine = RayEngine(num_workers=workers, early=ray_start.take_early())
    try:
        assert engine.map(abs, [-1, -2]) == [1, 2]
        assert engine._early is None and ray.cluster_resources()["CPU"] == workers
        assert not _ray_start_threads()  # the early one was stopped before this one started
    finally:
        engine.shutdown()
    assert not ray.is_initialized()
