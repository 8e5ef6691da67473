"""Notifications: when a run fails, or a training stage rolled back a loss spike, a JSON message
goes to a webhook and a Prefect event is emitted (build an Automation on `gristmill.run.failed`
or `gristmill.training.rollback` in the Prefect UI).

The webhook is a secret: `notify.webhook` names where to find it, `env:VARIABLE` or
`prefect-secret:BLOCK` (a Prefect Secret block), and is never the URL itself; the `notify`
section is left out of MLflow params, and the URL is never logged. A notification that cannot be
delivered is a warning: it never fails the run it reports on.
"""
from __future__ import annotations

import json
import logging
import os
import urllib.request
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gristmill.core.stage import Manifest, read_metrics

log = logging.getLogger("gristmill.notify")
SCHEMES = ("env:", "prefect-secret:")
TIMEOUT_S = 10


class NotifyConfig(BaseModel):
    """Where failure and rollback notifications go (never part of an artifact key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    webhook: str | None = Field(default=None, description="Where the webhook URL is kept: 'env:VARIABLE' "
                                                          "or 'prefect-secret:BLOCK'. None: Prefect "
                                                          "events only.")

    @field_validator("webhook")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(SCHEMES):
            raise ValueError("give where the URL is kept, 'env:VARIABLE' or 'prefect-secret:BLOCK', "
                             "not the URL: it is a secret and configs are logged")
        return value


def webhook_url(config: NotifyConfig) -> str | None:
    """The URL the reference names; ValueError when the variable or block is missing."""
    ref = config.webhook
    if ref is None:
        return None
    if ref.startswith("env:"):
        url = os.environ.get(ref[4:])
        if not url:
            raise ValueError(f"notify.webhook: environment variable {ref[4:]} is not set")
        return url
    from prefect.blocks.system import Secret

    # Called from synchronous code, so Prefect's async_dispatch returns the block, not a coroutine.
    secret = cast(Secret, Secret.load(ref.removeprefix("prefect-secret:")))
    return str(secret.get())


def _post(url: str, message: dict[str, Any]) -> None:
    request = urllib.request.Request(url, data=json.dumps(message).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        response.read()


def notify(config: NotifyConfig, event: str, run: dict[str, str], payload: dict[str, Any]) -> None:
    """Emit Prefect event `gristmill.<event>` about pipeline run `run` (its MLflow id and name)
    and POST {"event", "run", ...payload} to the webhook, if one is configured."""
    from prefect.events import emit_event

    message = {"event": f"gristmill.{event}", "run": run, **payload}
    resource = {"prefect.resource.id": f"gristmill.pipeline-run.{run['mlflow_run_id']}",
                "prefect.resource.name": run["name"]}
    for channel, send in (("Prefect event", lambda: emit_event(event=message["event"],
                                                               resource=resource, payload=message)),
                          ("webhook", lambda: (url := webhook_url(config)) and _post(url, message))):
        try:
            send()
        except Exception as error:  # a lost notification must not fail the run
            # an HTTP error's text may hold the URL, a secret: name only its type then
            log.warning("%s %s not delivered: %s", channel, message["event"],
                        type(error).__name__ if "://" in str(error) else error)


def rollbacks(manifest: Manifest) -> list[dict[str, Any]]:
    """The loss-spike rollbacks a training stage recorded (metrics.jsonl rows with `rollback`)."""
    return [{k: v for k, v in row.items() if k == "step" or k.startswith("rollback")}
            for row in read_metrics(manifest.path / "metrics.jsonl") if "rollback" in row]
