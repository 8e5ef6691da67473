"""GPU stages take turns under the Prefect global concurrency limit `gpu` when a server has one;
data stages never wait for it. Against a real Prefect server: the session's standing one
(`prefect_server`), which has the limit only while the test needs it."""
from __future__ import annotations

import contextvars
import threading
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.slow  # asks for the session's Prefect server


def _intervals(uses_gpu: bool) -> list[tuple[float, float]]:
    """Two stages computed at once: when each held its slot (or would have)."""
    from gristmill.flows.pipeline import _gpu_slot

    stage = SimpleNamespace(spec=SimpleNamespace(uses_gpu=uses_gpu))
    held: list[tuple[float, float]] = []

    def compute():
        with _gpu_slot(stage):
            start = time.monotonic()
            time.sleep(2.0)
            held.append((start, time.monotonic()))

    # each thread in a copy of this one's context: Prefect's settings (the server's URL) live there
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(compute,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return sorted(held)


def _overlap(held: list[tuple[float, float]]) -> bool:
    (_, first_end), (second_start, _) = held
    return second_start < first_end


def test_gpu_stages_take_turns_under_the_gpu_limit_and_data_stages_do_not_wait(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gristmill.flows.pipeline import GPU_LIMIT

    with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        assert _overlap(_intervals(uses_gpu=True))  # no limit on the server: nothing waits
        with get_client(sync_client=True) as client:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=1))
        try:
            gpu = _intervals(uses_gpu=True)
            data = _intervals(uses_gpu=False)
        finally:  # the session's later runs on this server must not take turns
            with get_client(sync_client=True) as client:
                client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
    assert len(gpu) == 2 and not _overlap(gpu), gpu  # one after the other
    assert len(data) == 2 and _overlap(data), data
