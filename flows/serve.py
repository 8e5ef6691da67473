"""`gristmill serve CONFIG [key=value ...]`: the `pipeline` deployment, served against a Prefect
server (`gristmill up`, or any PREFECT_API_URL), so a run can be started from the Prefect UI.

The deployment's parameters are the flow's: `config`, the typed pipeline config (the UI draws a
form from it: the preset name, each stage's section with every field and its description),
`until`, and free-form `overrides` (`key=value`, as on the command line). Its defaults are the
config file given to `serve`, overrides applied. Runs execute in this process's runner, with its
environment (GRISTMILL_HOME, MLFLOW_TRACKING_URI, RAY_ADDRESS); it serves until stopped.
A failed run can be retried from the UI: finished stages are reused from the artifact store and
the failed one resumes from its checkpoint, as `gristmill run` does after a crash.
"""
from __future__ import annotations

import os
from typing import Any

from flows.config import PipelineConfig

DEPLOYMENT = "pipeline"


def deployments(config: PipelineConfig) -> list[Any]:
    """The deployments `serve` registers, with `config` as their default parameters."""
    from flows.pipeline import pipeline

    return [pipeline.to_deployment(
        name=DEPLOYMENT, parameters={"config": config.model_dump(mode="json")},
        description=f"The gristmill pipeline, preset {config.name!r}: collect → tokenize → "
                    "pretrain → SFT → align → evaluate, each stage reused when already computed.",
        tags=["gristmill"])]


def serve(config: PipelineConfig) -> None:
    """Register the deployments and run the flow runs started from the UI, until stopped."""
    if not os.environ.get("PREFECT_API_URL"):
        raise ValueError("PREFECT_API_URL is not set: start the servers with `gristmill up` and "
                         "export what it prints (a deployment needs a standing Prefect server)")
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(config))
