"""MLflow tracking: the only package that imports mlflow.

    runs.py      a pipeline's parent run and its stage runs: params, metrics, lineage; read back
    models.py    the SFT and aligned models as MLflow logged models; metrics against them
    registry.py  the model registry: versions of the aligned model and their aliases
    corpus.py    a data refresh's corpus versions, as MLflow datasets

This module is what they share: where the tracking store is (`MLFLOW_TRACKING_URI` when set,
else a SQLite store under GRISTMILL_HOME) and a client whose unanswered requests raise one error.

When a tracking server stops answering (after MLflow's own retries, about four minutes by
default: `MLFLOW_HTTP_REQUEST_MAX_RETRIES`, `MLFLOW_HTTP_REQUEST_TIMEOUT`), the run fails with
one `TrackingUnavailable` line rather than carrying on untracked. Nothing computed is lost: a
stage's metrics live in its artifact (metrics.jsonl, manifest stats), and the next run that reuses
a stage whose computing MLflow run never finished logs them into its own stage run (runs.py).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from requests import exceptions as http_errors

from gristmill.infra import env

# What MLflow's REST client raises its MlflowException from (a timeout) or while handling (the
# rest): the server refused or dropped the connection, did not answer in time, or kept answering
# with a retryable status (429, 5xx) until MLflow's retries ran out.
NO_ANSWER = (http_errors.ConnectionError, http_errors.Timeout, http_errors.RetryError)


def tracking_uri(home: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or env.mlflow_store_uri(home)


def is_server(uri: str) -> bool:
    """A tracking server (its UI can be linked; it takes concurrent writers), not a local store."""
    return uri.startswith(("http://", "https://"))


def migrate_sqlite_store(db: Path) -> None:
    """Create MLflow's tables in a new SQLite file, migrated to this MLflow's revision (what its
    store does on first open, before it adds the Default experiment): MLflow's CLI command
    `mlflow db upgrade`, run in this process, which has imported mlflow already or is about to."""
    from mlflow.db import upgrade

    upgrade.main([f"sqlite:///{db}"], standalone_mode=False)


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server did not answer."""


def unanswered(error: BaseException) -> bool:
    """Whether `error` comes of a request the server did not answer: one of NO_ANSWER is in its
    chain of causes and contexts."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, NO_ANSWER):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


class Client:
    """An MlflowClient whose requests the server did not answer raise one TrackingUnavailable
    that names the server and the call; every other MLflow error passes through unchanged."""

    def __init__(self, uri: str):
        self.uri = uri
        self._client = MlflowClient(uri)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except (MlflowException, *NO_ANSWER) as error:
                if not unanswered(error):
                    raise
                raise TrackingUnavailable(
                    f"MLflow at {self.uri} is not answering ({name}); the stages finished so far "
                    "are kept and the next run logs them to MLflow") from error

        return call
