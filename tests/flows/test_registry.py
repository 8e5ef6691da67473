"""The model registry step (flows/registry.py) against a real MLflow SQLite store: versions
created from the align stage's logged model, candidate and champion aliases, promotion only on
better metrics, the reason recorded, lineage as tags."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from gristmill.core.stage import Manifest
from gristmill.flows.config import PipelineConfig, load_config
from gristmill.flows.registry import (
    CANDIDATE,
    CHAMPION,
    compare,
    evaluation_metrics,
    lower_is_better,
    register_and_promote,
)

STAGES = ("collect", "tokenize", "pretrain", "sft", "align", "evaluate")


def _manifests(root: Path, run: int, arith_acc: float, val_ppl: float) -> dict[str, Manifest]:
    """One pipeline run's manifests: an evaluate artifact with results.json; keys differ per run."""
    manifests = {}
    for stage in STAGES:
        path = root / f"{stage}-{run}"
        path.mkdir(parents=True)
        manifests[stage] = Manifest(stage=stage, key=f"{stage[:3]}{run:09d}", path=path, config={},
                                    upstream={}, files={}, stats={})
    models = {"base": {"arith_acc": 0.0, "val_ppl": 300.0}, "aligned": {"arith_acc": arith_acc, "val_ppl": val_ppl}}
    (manifests["evaluate"].path / "results.json").write_text(json.dumps({"models": models}))
    return manifests


def _log_align_model(tracker, manifests: dict[str, Manifest], run: int) -> tuple[str, str]:
    """A stand-in for the align stage's logged model (what flows/reports.publish_model logs): a
    READY logged model of an align stage run, tagged with the artifact, holding one file.
    Returns (model id, the run that logged it)."""
    from gristmill.infra.tracking.models import KEY_TAG, STAGE_TAG

    align = manifests["align"]
    stage_run = tracker.start_stage(tracker.start_pipeline("align", {}, {}), "align", align.key, {}, {})
    model = tracker.client.create_logged_model(tracker.experiment_id, source_run_id=stage_run,
                                               tags={STAGE_TAG: "align", KEY_TAG: align.key})
    files = align.path / "logged"
    files.mkdir()
    (files / "config.json").write_text(json.dumps({"run": run}))
    tracker.client.log_model_artifacts(model.model_id, str(files))
    tracker.client.finalize_logged_model(model.model_id, "READY")
    return model.model_id, stage_run


def _pipeline_run(tracker, tmp_path: Path, run: int, arith_acc: float, val_ppl: float,
                  logged: bool = True) -> tuple[str, dict[str, Manifest]]:
    manifests = _manifests(tmp_path / f"run{run}", run, arith_acc, val_ppl)
    if logged:
        _log_align_model(tracker, manifests, run)
    return _run(tracker, f"run {run}"), manifests


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from gristmill.infra import schemas
    from gristmill.infra.tracking.runs import Tracker

    schemas.seed_mlflow(tmp_path)  # a migrated store, as a run's new home gets
    return Tracker(tmp_path)


def _run(tracker, name: str) -> str:
    return tracker.start_pipeline(name, {}, {})


def test_candidate_becomes_champion_only_when_it_beats_it(tracker, tmp_path, monkeypatch):
    from mlflow.artifacts import download_artifacts
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.uri)
    config = load_config(None, ['registry.promote_on=["aligned.arith_acc", "aligned.val_ppl"]'])
    name = "gristmill-tiny"

    def aliases() -> dict[str, str]:
        return {alias: str(v) for alias, v in client.get_registered_model(name).aliases.items()}

    manifests = _manifests(tmp_path / "run1", 1, 0.10, 400.0)
    model_id, align_run = _log_align_model(tracker, manifests, 1)
    first_run = _run(tracker, "first")
    first = register_and_promote(config, tracker, first_run, manifests)
    assert (first.version, first.promoted, first.reason) == ("1", True, "no champion yet")
    assert aliases() == {CANDIDATE: "1", CHAMPION: "1"}
    version = client.get_model_version(name, "1")
    assert version.tags["gristmill.key.align"] == "ali000000001"
    assert {f"gristmill.key.{s}" for s in STAGES} <= set(version.tags)
    assert float(version.tags["gristmill.metric.aligned.arith_acc"]) == 0.10
    # created from the logged model, in the run that logged it; the pipeline run is a tag
    assert version.source == f"models:/{model_id}" and version.run_id == align_run
    assert version.tags["gristmill.pipeline_run_id"] == first_run
    # the registry pointed MLflow's process-wide tracking URI at the store only for the call
    assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.uri)  # models:/ URIs resolve through the environment
    model_dir = Path(download_artifacts(f"models:/{name}@{CHAMPION}", dst_path=str(tmp_path / "dl")))
    assert json.loads((model_dir / "config.json").read_text()) == {"run": 1}

    # More accurate but a worse perplexity: not better on every metric, so the champion stays.
    worse_run, worse_manifests = _pipeline_run(tracker, tmp_path, 2, 0.20, 450.0)
    worse = register_and_promote(config, tracker, worse_run, worse_manifests)
    assert (worse.version, worse.promoted, worse.champion) == ("2", False, "1")
    assert aliases() == {CANDIDATE: "2", CHAMPION: "1"}
    assert worse.reason == ("worse: aligned.arith_acc 0.2 > 0.1, aligned.val_ppl 450 > 400 "
                            "(champion version 1)")
    tags = client.get_run(worse_run).data.tags
    assert tags["gristmill.registry.decision"] == "candidate" and tags["gristmill.registry.reason"] == worse.reason
    assert client.get_model_version(name, "2").tags["gristmill.promotion"] == worse.reason
    assert "`champion` stays version 1" in worse.markdown()

    better_run, better_manifests = _pipeline_run(tracker, tmp_path, 3, 0.20, 380.0)
    better = register_and_promote(config, tracker, better_run, better_manifests)
    assert (better.version, better.promoted) == ("3", True)
    assert better.reason.startswith("better: aligned.arith_acc 0.2 > 0.1, aligned.val_ppl 380 < 400")
    assert aliases() == {CANDIDATE: "3", CHAMPION: "3"}
    assert client.get_run(better_run).data.tags["gristmill.registry.decision"] == "promoted"

    # A re-run that reused align and evaluate registers nothing new.
    again_run, again_manifests = _pipeline_run(tracker, tmp_path / "again", 3, 0.2, 380.0, logged=False)
    again = register_and_promote(config, tracker, again_run, again_manifests)
    assert (again.version, again.promoted) == ("3", False) and "already the champion" in again.reason
    assert len(client.search_model_versions(f"name = '{name}'")) == 3


def test_a_champion_registered_before_models_were_logged_is_replaced_by_its_logged_model(tracker, tmp_path):
    """A store from before logged models: the champion is a plain model directory of a run. The next
    run with the same lineage registers the aligned model again, from its logged model, and that
    version takes `champion`: what `mlflow models serve` can serve."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.uri)
    name = "gristmill-tiny"
    old_run, manifests = _pipeline_run(tracker, tmp_path, 1, 0.1, 400.0)
    lineage = {f"gristmill.key.{stage}": m.key for stage, m in manifests.items()}
    client.create_registered_model(name)
    client.create_model_version(name, f"runs:/{old_run}/model", run_id=old_run,
                                tags={**lineage, "gristmill.metric.aligned.arith_acc": "0.1"})
    client.set_registered_model_alias(name, CHAMPION, "1")

    decision = register_and_promote(PipelineConfig(), tracker, _run(tracker, "upgraded"), manifests)
    assert (decision.version, decision.promoted) == ("2", True)
    assert decision.reason == "the champion's model (version 1), as an MLflow model"
    assert client.get_model_version_by_alias(name, CHAMPION).source.startswith("models:/")
    again = register_and_promote(PipelineConfig(), tracker, _run(tracker, "again"), manifests)
    assert (again.version, again.promoted) == ("2", False)


def test_an_aligned_model_that_was_never_logged_is_an_error_naming_it(tracker, tmp_path):
    run_id, manifests = _pipeline_run(tracker, tmp_path, 1, 0.1, 400.0, logged=False)
    with pytest.raises(LookupError, match="no logged model of align-ali000000001"):
        register_and_promote(PipelineConfig(), tracker, run_id, manifests)


def test_comparison_direction_ties_and_nan():
    assert lower_is_better("aligned.val_ppl") and lower_is_better("sft.val_loss") and lower_is_better("base.val_bpb")
    assert not lower_is_better("aligned.arith_acc")
    on = ["aligned.arith_acc"]
    assert compare({"aligned.arith_acc": 0.3}, {"aligned.arith_acc": 0.2}, on)[0]
    assert compare({"aligned.arith_acc": 0.2}, {"aligned.arith_acc": 0.2}, on) == (
        False, "not better: aligned.arith_acc 0.2 = 0.2")
    assert not compare({"aligned.arith_acc": math.nan}, {"aligned.arith_acc": 0.2}, on)[0]
    assert compare({"aligned.val_ppl": 10.0}, {"aligned.val_ppl": 12.0}, ["aligned.val_ppl"])[0]
    promoted, why = compare({"aligned.arith_acc": 0.1}, {}, on)
    assert promoted and "champion not measured on it" in why


def test_missing_metric_is_an_error_listing_the_metrics(tmp_path):
    manifests = _manifests(tmp_path, 1, 0.1, 400.0)
    with pytest.raises(ValueError, match=r"'aligned.nope' is not a metric .*'aligned.arith_acc'"):
        evaluation_metrics(manifests["evaluate"].path, ["aligned.nope"])


def test_registry_config_defaults_and_name():
    config = PipelineConfig()
    assert config.registry.enabled and config.registry.promote_on == ["aligned.arith_acc"]
    assert config.registered_model_name == "gristmill-tiny"
    assert load_config(None, ["registry.model_name=lm"]).registered_model_name == "lm"
