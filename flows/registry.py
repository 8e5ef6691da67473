"""The model registry step of a pipeline run: register the aligned model, move the aliases.

After evaluate, the align stage's logged model (the MLflow model its run logged:
infra/tracking/models.py) is registered as a new version of `gristmill-<name>`
(`registry.model_name`), tagged with its lineage (the artifact key of every stage that produced
it: `gristmill.key.<stage>`) and the metrics it is judged on (`gristmill.metric.<model>.<metric>`).
It takes the alias `candidate`, and `champion` only when it beats the current champion on
`registry.promote_on` (flows/config.py): no worse on every metric and better on at least one;
lower is better for loss / ppl / bpb, higher otherwise.
The decision and its reason go into tags on the run (`gristmill.registry.*`) and on the version,
and into the `pipeline-summary` Prefect artifact.

A re-run whose align and evaluate stages were both reused registers nothing new: the version with
that lineage takes the candidate alias again and is judged as before. Unless that version predates
logged models (a plain model directory): then the model is registered again, from its logged
model, and takes over `champion` when that version held it. Aliases only; MLflow's
deprecated registry "stages" are never used. Load the champion with
`mlflow.pyfunc.load_model("models:/gristmill-tiny@champion")`, or serve it with
`mlflow models serve -m models:/gristmill-tiny@champion --env-manager local`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gristmill.core.stage import Manifest
from gristmill.flows.config import PipelineConfig
from gristmill.flows.stages import ALIGN, EVALUATE
from gristmill.infra.tracking.models import logged_model
from gristmill.infra.tracking.registry import ModelRegistry, ModelVersion
from gristmill.infra.tracking.runs import Tracker

CANDIDATE, CHAMPION = "candidate", "champion"
KEY_TAG, METRIC_TAG = "gristmill.key.", "gristmill.metric."
RESULTS = "results.json"  # the evaluate stage's per-model metrics: {"models": {label: {metric: value}}}
LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "bpb")


@dataclass(frozen=True, kw_only=True)
class Decision:
    model: str
    version: str
    promoted: bool
    reason: str
    champion: str  # the champion's version after the decision

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> Decision | None:
        """The decision recorded on a pipeline run (`gristmill.registry.*` tags), if any."""
        got = {k.removeprefix("gristmill.registry."): v for k, v in tags.items()
               if k.startswith("gristmill.registry.")}
        if not {"model", "version", "decision", "reason", "champion"} <= got.keys():
            return None
        return cls(model=got["model"], version=got["version"], promoted=got["decision"] == "promoted",
                   reason=got["reason"], champion=got["champion"])

    def markdown(self) -> str:
        verdict = ("`candidate`, promoted to `champion`" if self.promoted else
                   "`candidate` and `champion`" if self.champion == self.version else
                   f"`candidate`; `champion` stays version {self.champion}")
        return f"**Model registry:** `{self.model}` version {self.version}: {verdict} ({self.reason})."


def lower_is_better(metric: str) -> bool:
    return any(word in metric.split(".")[-1].lower() for word in LOWER_IS_BETTER)


def evaluation_metrics(evaluate_dir: Path, promote_on: list[str]) -> dict[str, float]:
    """The `promote_on` values from the evaluate stage's results.json; a name it lacks is an error
    listing what there is."""
    models = json.loads((Path(evaluate_dir) / RESULTS).read_text())["models"]
    values = {}
    for name in promote_on:
        label, metric = name.split(".")
        value = models.get(label, {}).get(metric)
        if not isinstance(value, (int, float)):
            there = sorted(f"{m}.{k}" for m, row in models.items() for k, v in row.items()
                           if isinstance(v, (int, float)))
            raise ValueError(f"registry.promote_on: {name!r} is not a metric in {RESULTS}; there are {there}")
        values[name] = float(value)
    return values


def compare(candidate: Mapping[str, float], champion: Mapping[str, float], promote_on: list[str]
            ) -> tuple[bool, str]:
    """(promote?, why): no worse on every metric and better on at least one. A metric the champion
    was not judged on (promote_on changed since) counts for the candidate; a NaN never wins."""
    better, worse, parts = 0, 0, []
    for name in promote_on:
        new, old = candidate[name], champion.get(name)
        if old is None:
            better += 1
            parts.append(f"{name} {new:.4g} (champion not measured on it)")
            continue
        sign = -1 if lower_is_better(name) else 1
        if math.isnan(new) or sign * (new - old) < 0:
            worse += 1
        elif sign * (new - old) > 0:
            better += 1
        op = "=" if new == old else (">" if new > old else "<")
        parts.append(f"{name} {new:.4g} {op} {old:.4g}")
    promote = better > 0 and worse == 0
    verdict = "better" if promote else ("worse" if worse else "not better")
    return promote, f"{verdict}: {', '.join(parts)}"


def _metrics_of(version: ModelVersion) -> dict[str, float]:
    return {k.removeprefix(METRIC_TAG): float(v) for k, v in version.tags.items() if k.startswith(METRIC_TAG)}


def _same_lineage(version: ModelVersion, lineage: Mapping[str, str]) -> bool:
    return all(version.tags.get(KEY_TAG + stage) == key for stage, key in lineage.items()
               if stage in (ALIGN.name, EVALUATE.name))


def _logged(version: ModelVersion) -> bool:
    """Created from a logged model, so MLflow can load and serve it; a version registered before
    models were logged holds a plain model directory."""
    return version.source.startswith("models:/")


def register_and_promote(config: PipelineConfig, tracker: Tracker, run_id: str,
                         manifests: Mapping[str, Manifest]) -> Decision:
    """Register the aligned model of `manifests` (the stages of one pipeline run, through
    evaluate) as `candidate`, promote it to `champion` when it beats the current one, and record
    the decision on run `run_id` and on the version."""
    name, promote_on = config.registered_model_name, config.registry.promote_on
    lineage = {stage: m.key for stage, m in manifests.items()}
    metrics = evaluation_metrics(manifests[EVALUATE.name].path, promote_on)
    registry = ModelRegistry(tracker.uri)
    known = next((v for v in registry.model_versions(name) if _same_lineage(v, lineage) and _logged(v)), None)
    version = known or registry.register_model(name, logged_model(tracker, ALIGN.name, manifests[ALIGN.name].key), {
        **{KEY_TAG + stage: key for stage, key in lineage.items()},
        **{METRIC_TAG + k: repr(v) for k, v in metrics.items()}, "gristmill.pipeline_run_id": run_id})
    registry.set_alias(name, CANDIDATE, version.version)
    champion = registry.version_by_alias(name, CHAMPION)
    if champion is None:
        promoted, reason = True, "no champion yet"
    elif champion.version == version.version:
        promoted, reason = False, "already the champion (align and evaluate reused)"
    elif _same_lineage(champion, lineage):  # and not _logged(champion): the same model, now servable
        promoted, reason = True, f"the champion's model (version {champion.version}), as an MLflow model"
    else:
        promoted, reason = compare(metrics, _metrics_of(champion), promote_on)
        reason = f"{reason} (champion version {champion.version})"
    if promoted:
        registry.set_alias(name, CHAMPION, version.version)
    decision = Decision(model=name, version=version.version, promoted=promoted, reason=reason,
                        champion=version.version if promoted or champion is None else champion.version)
    tracker.set_tags(run_id, {f"gristmill.registry.{key}": value for key, value in {
        "model": name, "version": version.version, "reason": reason,
        "decision": "promoted" if promoted else "candidate", "champion": decision.champion}.items()})
    registry.set_version_tag(name, version.version, "gristmill.promotion", reason)
    return decision
