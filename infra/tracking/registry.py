"""MLflow's model registry: versions of a registered model, their tags and aliases.

Aliases only (`candidate`, `champion`: flows/registry.py decides); MLflow's deprecated registry
"stages" are never used. A version's files are a plain HF model directory logged into a run,
not an MLflow flavor: `mlflow.artifacts.download_artifacts("models:/NAME@champion")` fetches it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from infra.tracking import Client


@dataclass(frozen=True, kw_only=True)
class ModelVersion:
    """One version of a registered model, as plain data: its number, tags and aliases."""

    name: str
    version: str
    tags: dict[str, str]
    aliases: tuple[str, ...]


def _version(mv: Any) -> ModelVersion:
    return ModelVersion(name=mv.name, version=str(mv.version), tags=dict(mv.tags or {}),
                        aliases=tuple(mv.aliases or ()))


class ModelRegistry:
    """The registered models of the tracking store at `uri`."""

    def __init__(self, uri: str):
        self.client = Client(uri)

    def register_model(self, name: str, run_id: str, model_dir: Path,
                       tags: Mapping[str, str]) -> ModelVersion:
        """Log `model_dir` into run `run_id` as its `model/` artifact and register that as a new
        version of `name` (the registered model is created on first use)."""
        self.client.log_artifacts(run_id, str(model_dir), "model")
        try:
            self.client.create_registered_model(name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        return _version(self.client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id,
                                                         tags=dict(tags)))

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
