"""No local Ray is started ahead of its stage: the stage's `RayEngine` (infra/ray_engine.py)
starts one on first use. Starting it on a thread beside the run's start-up saved less than a cold
run's 3 s bar for a start-up trick (docs/benchmarks.md, "Start-up tricks"), so it went.
`take_early` answers the flow's question for such a Ray (flows/pipeline.py): there is none.
"""
from __future__ import annotations


def take_early() -> None:
    """The Ray started ahead of need for the next stage: never any (see the module doc)."""
    return None
