"""A launched rank (flows/launched.py) reports what the object store cost every rank, not only rank
0: the retries each rank's process took, summed over the process group."""
from __future__ import annotations

import multiprocessing

from gristmill.core import object_store
from gristmill.flows.launched import store_retries_of_every_rank
from gristmill.infra.launch import free_port

QUICK = object_store.RetryPolicy(first_pause_s=0.001)  # tests must not sleep for seconds


def _one_of_two_ranks(rank: int, port: int, results) -> None:
    """Rank `rank` of two over gloo: `rank + 1` bucket calls, each reset once, then the sum."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for _ in range(rank + 1):
        answers = iter([ConnectionResetError("reset by peer"), b"ok"])

        def read() -> bytes:
            answer = next(answers)  # noqa: B023  (called before the loop moves on)
            if isinstance(answer, Exception):
                raise answer
            return answer
        QUICK.call("s3://crawl/object", "reading", read)
    results.put((rank, object_store.retries(), store_retries_of_every_rank()))
    dist.destroy_process_group()


def test_every_ranks_retries_are_summed():
    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    procs = [context.Process(target=_one_of_two_ranks, args=(rank, port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert got == [(0, 1, 3), (1, 2, 3)]


def test_a_process_outside_a_launch_reports_its_own():
    before = object_store.retries()
    assert store_retries_of_every_rank() == before
