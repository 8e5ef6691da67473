"""Why a stage computes: what differs between its planned key and the nearest committed artifact of
that stage in the store (`gristmill run CONFIG --dry-run --explain`, and the stage's task log
when it computes).

A key hashes the stage's version, its hashed config, its upstream keys and a fingerprint of its
external inputs (infra/artifacts.stage_key), so those are the four things that can differ. The
nearest artifact is the one with the fewest differences; an upstream that differs computes in the
same run (its own reasons come first) or is another committed artifact.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from gristmill.flows.dag import PlannedStage
from gristmill.infra.artifacts import ArtifactStore


def _flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted keys (what an override names) and their leaf values."""
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            yield from _flat(inner, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), value


def _hashed(stage: PlannedStage, recorded: dict[str, Any]) -> dict[str, Any]:
    """The hashed part of a manifest's recorded config, as the stage's config type sees it today
    (a config of an older schema is compared as it was recorded)."""
    try:
        return type(stage.config).model_validate(recorded).hashed_dict()
    except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
        return recorded


def differences(stage: PlannedStage, manifest: dict[str, Any], keys: Mapping[str, str],
                computing: set[str]) -> list[str]:
    """What differs between `stage` as planned and a committed `manifest` of that stage, one line each.
    `keys`: every planned stage's key; `computing`: the planned stages that will compute."""
    name = stage.spec.name
    lines = []
    old_version = manifest.get("meta", {}).get("stage_version")
    if old_version != stage.spec.version:
        lines.append(f"stage version {old_version} -> {stage.spec.version} (the stage's code changed)")
    old, new = dict(_flat(_hashed(stage, manifest.get("config", {})))), dict(_flat(stage.config.hashed_dict()))
    lines += [f"{name}.{key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}"
              for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
    for upstream in stage.spec.upstream:
        was = manifest.get("upstream", {}).get(upstream)
        if was != keys[upstream]:
            why = "computed in this run, see above" if upstream in computing else "another committed artifact"
            lines.append(f"upstream {upstream}: {was} -> {keys[upstream]} ({why})")
    old_inputs = manifest.get("meta", {}).get("inputs_fingerprint", "(not recorded)")
    if stage.inputs_fingerprint is not None and old_inputs != stage.inputs_fingerprint:
        lines.append(f"input files changed: fingerprint {str(old_inputs)[:12]} -> {stage.inputs_fingerprint[:12]}")
    return lines


def explain(planned: list[PlannedStage], store: ArtifactStore) -> dict[str, list[str]]:
    """stage -> why it computes, for every planned stage that will: the nearest committed artifact
    and what differs from it (or that the store holds none of that stage)."""
    keys = {p.spec.name: p.key for p in planned}
    computing = {p.spec.name for p in planned if not p.complete}
    reasons = {}
    for stage in planned:
        if stage.complete:
            continue
        found = [(differences(stage, m, keys, computing), m) for m in store.manifests(stage.spec.name)]
        if not found:
            reasons[stage.spec.name] = ["no artifact of this stage in the store yet"]
            continue
        lines, nearest = min(found, key=lambda pair: len(pair[0]))
        reasons[stage.spec.name] = [f"nearest: {stage.spec.name}-{nearest['key']}", *(lines or [
            "nothing in its key differs: the artifact is incomplete or damaged (`gristmill verify`)"])]
    return reasons


def format_reasons(reasons: Mapping[str, list[str]]) -> str:
    return "".join(f"{stage}:\n" + "".join(f"  {line}\n" for line in lines) for stage, lines in reasons.items())
