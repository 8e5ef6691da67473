"""`gristmill serve CONFIG [key=value ...] [--refresh-cron CRON]`: the `pipeline` and `data-refresh`
deployments, served against a Prefect server (`gristmill up`, or any PREFECT_API_URL), so a run
can be started from the Prefect UI and the data refresh runs on its schedule (`refresh.cron`;
flows/refresh.py), starting `pipeline` when enough new data came in.

The deployment's parameters are the flow's: `config`, the typed pipeline config (the UI draws a
form from it: the preset name, each stage's section with every field and its description),
`until`, and free-form `overrides` (`key=value`, as on the command line). Its defaults are the
config file given to `serve`, overrides applied. Runs execute in this process's runner, with its
environment (GRISTMILL_HOME, MLFLOW_TRACKING_URI, RAY_ADDRESS); it serves until stopped. The CLI
runs it as a supervised child (flows/supervised.py), so Ctrl-C or SIGTERM stops it, and the flow
runs it started, within seconds even when the Prefect server is gone.
A failed run can be retried from the UI: finished stages are reused from the artifact store and
the failed one resumes from its checkpoint, as `gristmill run` does after a crash.
"""
from __future__ import annotations

import os
from typing import Any

from gristmill.flows.config import PipelineConfig

DEPLOYMENT = "pipeline"


def deployments(config: PipelineConfig) -> list[Any]:
    """The deployments `serve` registers, with `config` as their default parameters."""
    from gristmill.flows.pipeline import pipeline
    from gristmill.flows.refresh import DEPLOYMENT as REFRESH
    from gristmill.flows.refresh import data_refresh

    parameters = {"config": config.model_dump(mode="json")}
    return [pipeline.to_deployment(
        name=DEPLOYMENT, parameters=parameters,
        description=f"The gristmill pipeline, preset {config.name!r}: collect → tokenize → "
                    "pretrain → SFT → align → evaluate, each stage reused when already computed.",
        tags=["gristmill"]),
        data_refresh.to_deployment(
            name=REFRESH, parameters=parameters, cron=config.refresh.cron,
            description="What is new in collect.sources since the last refresh, collected and "
                        "deduplicated against every earlier corpus version into the next one; "
                        f"starts {config.refresh.deployment!r} past refresh.min_new_tokens.",
            tags=["gristmill"])]


def serve(config: PipelineConfig) -> None:
    """Register the deployments and run the flow runs started from the UI, until stopped."""
    if not os.environ.get("PREFECT_API_URL"):
        raise ValueError("PREFECT_API_URL is not set: start the servers with `gristmill up` and "
                         "export what it prints (a deployment needs a standing Prefect server)")
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(config))
