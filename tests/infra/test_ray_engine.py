"""The Ray engine: results in input order whatever the worker count, a worker killed mid-call is
restarted and the call retried, the node of each unit and the workers' object-store retries
counted, and a local Ray keeps its session
folder in a temp root of its own, which it leaves behind neither after its shutdown nor after a
start that was interrupted."""
from __future__ import annotations

import logging
import os
import signal
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from gristmill.core import object_store, progress
from gristmill.infra.ray_engine import RayEngine
from gristmill.infra.supervisor import SCRATCH_ENV


def test_a_killed_worker_is_restarted_its_call_retried_and_the_session_dir_removed(tmp_path, monkeypatch, caplog):
    """... and the map reports its units as they finish (core/progress.py), each once, and the
    object-store retries its workers took."""
    def square_killing_once(n: int) -> int:  # nested, so Ray ships it by value to the workers
        """The first call for 3 kills its own worker process, as an OOM killer would; the call for 5
        reads a bucket whose first answer is a reset connection."""
        marker = tmp_path / f"killed-{n}"
        if n == 3 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if n == 5:
            answers = iter([ConnectionResetError("reset by peer"), n])

            def read() -> int:
                answer = next(answers)
                if isinstance(answer, Exception):
                    raise answer
                return answer
            assert object_store.POLICY.call("s3://crawl/unit-5", "reading", read) == n
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
        assert engine.store_retries == 1  # the worker's, which this process's count does not hold
        root = engine._temp_root
        assert root is not None and len(list(root.glob("session_2*"))) == 1
    finally:
        engine.shutdown()
    assert not root.exists()


def test_a_local_ray_listens_on_loopback_only_and_a_run_starts_it_once_for_its_data_stages():
    """Every socket Ray's processes listen on (GCS, raylet, agents, workers, its API server) is
    on 127.0.0.1: without the single-machine switch they listen on every interface. A stage that
    leaves its local Ray to the next (collect, then tokenize) hands over that instance, and the
    next stage's engine stops it; `release_local` stops one that no stage took over."""
    import psutil
    import ray

    from gristmill.infra import ray_engine
    from gristmill.infra.processes import process_tree

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
        root, session = engine._temp_root, ray.get_runtime_context().get_node_id()
    finally:
        engine.shutdown(keep_local=True)
    assert len({name for *_, name in listening}) >= 3, listening  # gcs_server, raylet, workers...
    assert {ip for ip, *_ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening

    assert ray.is_initialized() and root is not None and root.exists()
    following = RayEngine(num_workers=2)
    try:
        assert following.map(abs, [-3, -4]) == [3, 4]
        assert ray.get_runtime_context().get_node_id() == session and following._temp_root == root
    finally:
        following.shutdown(keep_local=True)
    ray_engine.release_local()  # the run ends with no later stage to take it over
    assert not ray.is_initialized() and not root.exists()
    ray_engine.release_local()  # nothing left: a no-op


def test_a_single_call_runs_here_without_starting_ray(monkeypatch):
    """One item has nothing to run beside it: no local Ray is started for it (its start-up is
    seconds); two items start Ray as before."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    engine = RayEngine(num_workers=2)
    try:
        assert engine.map(lambda _: os.getpid(), [None]) == [os.getpid()]
        assert not ray.is_initialized() and engine._temp_root is None
        assert engine.map(abs, [-1, -2]) == [1, 2] and ray.is_initialized()
    finally:
        engine.shutdown()


def test_a_local_ray_lives_in_the_scratch_folder_and_an_interrupted_start_leaves_nothing(tmp_path, monkeypatch):
    """With a supervisor's scratch folder (infra/supervisor.py), a local Ray's temp root is a new
    folder inside it, not the shared /tmp/ray; Ctrl-C as `ray.init` returns stops that Ray and
    removes its root."""
    import ray

    from gristmill.infra import ray_engine

    scratch = Path(tempfile.mkdtemp(prefix="gm-"))  # short: Ray's socket paths are below it
    monkeypatch.setenv(SCRATCH_ENV, str(scratch))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    shared = set(Path("/tmp/ray").glob("session_2*"))
    real_init, seen = ray.init, []

    def init_then_ctrl_c(**kwargs):
        real_init(**kwargs)
        seen.extend(Path(kwargs["_temp_dir"]).glob("session_2*"))
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", init_then_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            ray_engine.init_local(1)
        assert len(seen) == 1 and seen[0].parent.parent == scratch, seen
        assert not ray.is_initialized() and not seen[0].parent.exists() and list(scratch.iterdir()) == []
        own = {p for p in set(Path("/tmp/ray").glob("session_2*")) - shared if p.name.endswith(f"_{os.getpid()}")}
        assert not own, own
    finally:
        ray.shutdown()
        scratch.rmdir()
