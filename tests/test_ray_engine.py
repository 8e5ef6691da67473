"""The Ray engine: results in input order whatever the worker count, a worker killed mid-call is
restarted and the call retried, and a local Ray leaves no session directory behind."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from infra.ray_engine import RayEngine


def test_a_killed_worker_is_restarted_its_call_retried_and_the_session_dir_removed(tmp_path):
    def square_killing_once(n: int) -> int:  # nested, so Ray ships it by value to the workers
        """The first call for 3 kills its own worker process, as an OOM killer would."""
        marker = tmp_path / f"killed-{n}"
        if n == 3 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return n * n

    engine = RayEngine(num_workers=2)
    try:
        assert engine.map(square_killing_once, list(range(8))) == [n * n for n in range(8)]
        assert (tmp_path / "killed-3").exists()  # the fault did happen
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
