"""MLflow's model registry: versions of a registered model, their tags and aliases.

Aliases only (`candidate`, `champion`: flows/registry.py decides); MLflow's deprecated registry
"stages" are never used. A version is created from a logged model (models.py), its source
`models:/<model_id>`, so `mlflow.pyfunc.load_model("models:/NAME@champion")` loads it and
`mlflow models serve -m models:/NAME@champion` serves it.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from gristmill.infra.tracking import Client


@dataclass(frozen=True, kw_only=True)
class ModelVersion:
    """One version of a registered model, as plain data: its number, source, tags and aliases."""

    name: str
    version: str
    source: str  # models:/<model_id> of its logged model (runs:/<run>/model before models were logged)
    tags: dict[str, str]
    aliases: tuple[str, ...]


def _version(mv: Any) -> ModelVersion:
    return ModelVersion(name=mv.name, version=str(mv.version), source=mv.source, tags=dict(mv.tags or {}),
                        aliases=tuple(mv.aliases or ()))


@contextlib.contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's SQL registry store looks the logged model of a `models:/<model_id>` source up
    through the process's tracking URI, not its client's (a TODO in its create_model_version):
    point that at `uri` for the call, then back (MLFLOW_TRACKING_URI as it was)."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        # None unsets it (MLflow's annotation omits None)
        mlflow.set_tracking_uri(before)  # pyright: ignore[reportArgumentType]


class ModelRegistry:
    """The registered models of the tracking store at `uri`."""

    def __init__(self, uri: str):
        self.client = Client(uri)

    def register_model(self, name: str, model_id: str, tags: Mapping[str, str]) -> ModelVersion:
        """Register logged model `model_id` as a new version of `name` (the registered model is
        created on first use); the version's run is the one that logged the model."""
        try:
            self.client.create_registered_model(name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        with _global_tracking_uri(self.client.uri):
            return _version(self.client.create_model_version(name, f"models:/{model_id}", tags=dict(tags),
                                                             model_id=model_id))

    def model_versions(self, name: str) -> list[ModelVersion]:
        """Every version of registered model `name`, oldest first (none when it does not exist);
        their `aliases` are empty: a search does not return them (use version_by_alias)."""
        escaped = name.replace("'", "\\'")
        found = self.client.search_model_versions(f"name = '{escaped}'")
        return sorted((_version(mv) for mv in found), key=lambda v: int(v.version))

    def version_by_alias(self, name: str, alias: str) -> ModelVersion | None:
        """The version `alias` points at; None when the model or the alias does not exist."""
        try:
            return _version(self.client.get_model_version_by_alias(name, alias))
        except MlflowException as error:
            if error.error_code not in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):
                raise
            return None

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, version)

    def set_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        self.client.set_model_version_tag(name, version, key, value)
