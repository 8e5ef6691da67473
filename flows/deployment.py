"""The deployment entrypoint of prefect.yaml (`flows/deployment.py:pipeline`): the pipeline flow
(flows/pipeline.py), imported once the process is configured (flows/entry.py)."""
from __future__ import annotations

import gristmill.flows.entry  # noqa: F401  first: configures the process before the flow's imports
from gristmill.flows.pipeline import pipeline

__all__ = ["pipeline"]
