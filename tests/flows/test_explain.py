"""Why a stage runs: what differs between its planned key and the nearest artifact of that stage in
the store (flows/explain.py, `gristmill run --dry-run --explain`)."""
from __future__ import annotations

import json

import pytest
from pipeline_helpers import REPO, gristmill

from gristmill.flows.config import load_config
from gristmill.flows.dag import plan
from gristmill.flows.explain import explain
from gristmill.infra.artifacts import MANIFEST, ArtifactStore


def _commit_by_hand(store: ArtifactStore, stage: str, key: str, **record) -> None:
    directory = store.final_dir(stage, key)
    directory.mkdir(parents=True)
    (directory / MANIFEST).write_text(json.dumps({"stage": stage, "key": key, "files": {}, "stats": {}, **record}))


def test_each_part_of_a_key_that_differs_is_named(tmp_path):
    store = ArtifactStore(tmp_path)
    config = load_config(REPO / "configs" / "tiny.yaml", ["pretrain.lr=0.002"])
    planned = {p.spec.name: p for p in plan(config, store, until="sft")}
    collect, pretrain = planned["collect"], planned["pretrain"]
    _commit_by_hand(store, "collect", "a" * 12, config=collect.config.model_dump(mode="json"), upstream={},
                    meta={"stage_version": collect.spec.version, "inputs_fingerprint": "f" * 64})
    old_pretrain = {**pretrain.config.model_dump(mode="json"), "lr": 0.003}
    _commit_by_hand(store, "pretrain", "b" * 12, config=old_pretrain, upstream={"tokenize": "c" * 12},
                    meta={"stage_version": pretrain.spec.version - 1})
    _commit_by_hand(store, "pretrain", "d" * 12, config={**old_pretrain, "seed": 7, "max_steps": 1},
                    upstream={"tokenize": "c" * 12}, meta={"stage_version": pretrain.spec.version - 1})

    reasons = explain(list(planned.values()), store)
    assert reasons["collect"] == [
        f"nearest: collect-{'a' * 12}",
        f"input files changed: fingerprint {'f' * 12} -> {collect.inputs_fingerprint[:12]}"]
    assert reasons["tokenize"] == ["no artifact of this stage in the store yet"]
    assert reasons["pretrain"] == [  # the nearest of the two: fewer differences
        f"nearest: pretrain-{'b' * 12}",
        f"stage version {pretrain.spec.version - 1} -> {pretrain.spec.version} (the stage's code changed)",
        "pretrain.lr: 0.003 -> 0.002",
        f"upstream tokenize: {'c' * 12} -> {planned['tokenize'].key} (computed in this run, see above)"]


@pytest.mark.slow
def test_dry_run_explain_names_the_changed_key_and_its_downstream(tiny_run):
    out = gristmill(tiny_run.home, "run", "configs/tiny.yaml", *tiny_run.overrides, "pretrain.lr=0.002",
                    "--dry-run", "--explain").stdout
    plan_rows, why = out.split("# why each stage that runs does", 1)
    assert "pretrain " in plan_rows and "blocked_domains" not in plan_rows  # the plan, not the config dump
    assert "collect:" not in why and "tokenize:" not in why  # reused: nothing to explain
    pretrain, sft = why.split("\npretrain:\n", 1)[1].split("\nsft:\n", 1)
    assert f"pretrain.lr: {load_config(REPO / 'configs' / 'tiny.yaml').pretrain.lr} -> 0.002" in pretrain
    assert "upstream pretrain:" in sft and "(computed in this run, see above)" in sft
    assert "sft.lr" not in sft
