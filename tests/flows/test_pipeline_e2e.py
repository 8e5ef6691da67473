"""The tiny pipeline end to end through the real CLI: Prefect (ephemeral API), MLflow on a SQLite
store, Ray started locally — in a temp GRISTMILL_HOME. Checks reuse on re-run, partial re-runs
after a config change, lineage in MLflow, and that the exported model loads and chats."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import REPO, STAGES, committed_dir, gristmill, plan_of

from gristmill.flows.config import load_config

pytestmark = pytest.mark.slow


def artifact_files(home: Path) -> dict[str, tuple[int, int]]:
    root = home / "artifacts"
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")}


def test_tiny_run_computes_every_stage_and_commits_manifests(tiny_run):
    home, proc = tiny_run.home, tiny_run.proc
    for stage in STAGES:
        manifests = list((home / "artifacts" / stage).glob("*/manifest.json"))
        assert len(manifests) == 1, stage
        manifest = json.loads(manifests[0].read_text())
        assert manifest["stage"] == stage and manifest["meta"]["mlflow_run_id"]
    assert not list((home / "artifacts").glob("*/*.partial"))
    evaluate = json.loads((committed_dir(home, "evaluate") / "manifest.json").read_text())
    assert evaluate["stats"]["base_val_bpb"] > 0
    log = proc.stdout + proc.stderr
    assert "computing" in log
    # collect, the first stage to compute, started a local Ray with its workers
    assert "ray: local, 2 workers" in log, log[-3000:]


def test_rerun_reuses_everything_and_changes_no_file(tiny_run, prefect_server):
    """Against the session's standing Prefect server: reuse is decided by the artifact store alone."""
    home = tiny_run.home
    before = artifact_files(home)
    proc = gristmill(home, "run", "configs/tiny.yaml", *tiny_run.overrides, services=prefect_server)
    log = proc.stdout + proc.stderr
    assert all(f"{stage}: reused" in log for stage in STAGES), log[-3000:]
    assert "computing" not in log
    assert "gristmill.ray" not in log  # no stage computes: no Ray was started for one
    assert artifact_files(home) == before


def test_changing_one_stage_reruns_it_and_downstream_only(tiny_run):
    home = tiny_run.home
    plan = plan_of(home, tiny_run.overrides, "sft.lr=0.0005")
    assert plan == {"collect": "reuse", "tokenize": "reuse", "pretrain": "reuse",
                    "sft": "run", "align": "run", "evaluate": "run"}


def test_unknown_override_is_an_error_naming_the_key(tiny_run):
    home = tiny_run.home
    env = {**os.environ, "GRISTMILL_HOME": str(home)}
    proc = subprocess.run([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", "sft.lrr=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "sft.lrr" in proc.stderr


# SFT mixes pretraining text into its batches (sft.pretrain_mix) so that the model keeps its
# language. Measured on this shortened run (`bench/harness/runs.py` SHORT, then the same with sft.seed=S,
# 2026-12-03, 2-core machine): validation perplexity of the SFT model over the Muon-pretrained base
# model's (200.0): x1.298, 1.266, 1.295, 1.279 for seeds 0-3. On the AdamW base (1114, 2026-12-01) it was
# x1.278 to x1.323 over seeds 0-3, and x2.02 with sft.pretrain_mix=0 (seeds 0, 1). The bound sits
# between the two, nearer the mix.
SFT_PPL_RATIO_FAST = 1.45


def test_sft_keeps_the_base_models_language(tiny_run):
    """The evaluate stage's validation perplexity of the SFT model against the base model's,
    measured in the same stage on the same tokens."""
    models = json.loads((tiny_run.committed["evaluate"] / "results.json").read_text())["models"]
    assert models["sft"]["val_ppl"] <= SFT_PPL_RATIO_FAST * models["base"]["val_ppl"]


def test_mlflow_has_parent_and_stage_runs_with_lineage(tiny_run):
    home = tiny_run.home
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    experiment = client.get_experiment_by_name("gristmill")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("gristmill.kind") == "pipeline"]
    assert len(parents) >= 2  # the first run and the re-run
    first = min(parents, key=lambda r: r.info.start_time)
    children = {r.data.tags["gristmill.stage"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == first.info.run_id}
    assert sorted(children) == sorted(STAGES)
    assert all(r.info.status == "FINISHED" for r in children.values())
    sft = children["sft"]
    assert sft.data.params["lr"] and sft.data.tags["gristmill.reused"] == "false"
    assert sft.data.tags["gristmill.upstream.pretrain.run_id"] == children["pretrain"].info.run_id
    datasets = {d.dataset.name: d.dataset for d in sft.inputs.dataset_inputs}
    keys = {stage: children[stage].data.tags["gristmill.key"] for stage in ("tokenize", "pretrain")}
    assert sorted(datasets) == sorted(f"{stage}-{key}" for stage, key in keys.items())  # tokenize: text mixed in
    assert datasets[f"pretrain-{keys['pretrain']}"].digest == keys["pretrain"]
    tokenize = children["tokenize"].data.metrics
    assert tokenize["bytes_per_token"] > 1 and tokenize["reference_bytes_per_token"] > 1
    loss = client.get_metric_history(children["pretrain"].info.run_id, "loss")
    assert len(loss) >= 10 and loss[-1].value < loss[0].value
    evaluate = children["evaluate"]
    assert {"upstream:tokenize", "upstream:align"} <= {
        t.value for d in evaluate.inputs.dataset_inputs for t in d.tags}
    artifacts = {a.path for a in client.list_artifacts(evaluate.info.run_id)}
    assert {"results.json", "contamination.json", "manifest.json", "config.json"} <= artifacts
    collect = children["collect"]
    charts = {a.path for a in client.list_artifacts(collect.info.run_id, "charts")}
    assert charts == {"charts/funnel.png", "charts/languages.png"}
    assert collect.data.metrics["docs_after_language"] <= collect.data.metrics["docs_after_extracted"]


def test_aligned_model_is_registered_with_lineage_and_aliases(tiny_run):
    """The first run's aligned model is version 1 of gristmill-tiny, candidate and champion then (no
    champion before it); the newest version is the candidate; a re-run that reuses align and
    evaluate registers no new version, so no two versions share that lineage. Version 1 was
    created from the logged model of the first run's align stage."""
    home = tiny_run.home
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    versions = {str(v.version): v for v in client.search_model_versions("name = 'gristmill-tiny'")}
    aliases = {alias: str(v) for alias, v in client.get_registered_model("gristmill-tiny").aliases.items()}
    assert aliases["candidate"] == max(versions, key=int) and aliases["champion"] in versions
    first = client.get_model_version("gristmill-tiny", "1")
    pipeline_run = first.tags["gristmill.pipeline_run_id"]
    experiment = client.get_experiment_by_name("gristmill").experiment_id
    stage_runs = {r.data.tags["gristmill.stage"]: r for r in
                  client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{pipeline_run}'")}
    assert {stage: first.tags[f"gristmill.key.{stage}"] for stage in STAGES} == {
        stage: r.data.tags["gristmill.key"] for stage, r in stage_runs.items()}
    assert "gristmill.metric.aligned.arith_acc" in first.tags
    lineages = {(v.tags["gristmill.key.align"], v.tags["gristmill.key.evaluate"]) for v in versions.values()}
    assert len(lineages) == len(versions)
    run = client.get_run(pipeline_run)
    assert run.data.tags["gristmill.kind"] == "pipeline"
    assert run.data.tags["gristmill.registry.decision"] == "promoted"
    assert run.data.tags["gristmill.registry.reason"] == "no champion yet"
    align_run = stage_runs["align"].info.run_id
    [model] = client.get_run(align_run).outputs.model_outputs
    assert first.source == f"models:/{model.model_id}" and first.run_id == align_run
    assert client.get_logged_model(model.model_id).tags["gristmill.key"] == first.tags["gristmill.key.align"]


def test_each_runs_models_are_logged_once_and_scored_against_their_data(tiny_run):
    """The SFT and aligned models are logged models of the stage runs that computed them, and of
    no reused run; the evaluate run scored each against its data (the val split, the arithmetic
    problems, each benchmark file)."""
    home = tiny_run.home
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    experiment = client.get_experiment_by_name("gristmill").experiment_id
    for stage in ("sft", "align"):
        key = json.loads((committed_dir(home, stage) / "manifest.json").read_text())["key"]
        [model] = client.search_logged_models([experiment], filter_string=f"tags.`gristmill.key` = '{key}'")
        source = client.get_run(model.source_run_id).data.tags
        assert (model.status, source["gristmill.stage"], source["gristmill.reused"]) == ("READY", stage, "false")
        assert model.name == f"{stage}-{key}"
    evaluate = json.loads((committed_dir(home, "evaluate") / "manifest.json").read_text())
    evaluate_run = client.get_run(evaluate["meta"]["mlflow_run_id"])
    [aligned] = client.search_logged_models(
        [experiment], filter_string=f"tags.`gristmill.key` = '{evaluate['upstream']['align']}'")
    scored = {m.key: m.dataset_name for m in client.get_logged_model(aligned.model_id).metrics}
    assert scored["aligned_val_ppl"] == f"tokenize-{evaluate['upstream']['tokenize']}"
    assert scored["aligned_arith_acc"] == "arithmetic-test"
    assert scored["aligned_arc_easy_part1_acc"] == "arc_easy_part1"
    assert scored["aligned_val_ppl"] in {d.dataset.name for d in evaluate_run.inputs.dataset_inputs}
    assert aligned.model_id in {m.model_id for m in evaluate_run.inputs.model_inputs}


def test_prefect_shows_the_funnel_and_the_report_card(tiny_run):
    home = tiny_run.home
    import sqlite3

    with sqlite3.connect(home / "prefect" / "prefect.db") as db:
        rows = list(db.execute("select key, data from artifact"))
        # newest first, so each key keeps the shared run's own (the first run in this home)
        progress = {key: (float(data), description) for key, data, description in db.execute(
            "select key, data, description from artifact where type = 'progress' order by created desc")}
    artifacts = dict(rows)
    assert {"collect-funnel", "pipeline-summary", "report-card"} <= set(artifacts)
    # every stage computed, and each left its progress artifact at 100% (flows/progress.py)
    assert {key: value for key, (value, _) in progress.items()} == {f"progress-{s}": 100.0 for s in STAGES}
    assert all(description.startswith(f"{key.removeprefix('progress-')}: done in ")
               for key, (_, description) in progress.items()), progress
    assert "sft: train 30/30 steps (100%)" in progress["progress-sft"][1]  # the loop's last step
    assert "| quality_heuristics |" in artifacts["collect-funnel"]
    summaries = [data for key, data in rows if key == "pipeline-summary"]
    assert any("**Model registry:** `gristmill-tiny` version 1: `candidate`, promoted to `champion`" in s
               for s in summaries)


def test_final_model_loads_with_auto_classes_and_chats(tiny_run):
    home = tiny_run.home
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = committed_dir(home, "align") / "model"
    assert not list(model_dir.glob("*.bin")) and list(model_dir.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(out[0, ids["input_ids"].shape[1]:]), str)


# ---------------------------------------------------------------- the alignment claims, tiny preset

@pytest.fixture(scope="module")
def tiny_preset_methods(tiny_run, prefect_server):
    """The tiny preset as shipped (full pretraining and SFT), aligned with each method; collect and
    tokenize are reused from the first run. Every method trains data-parallel, 2 processes under
    Accelerate (the launch is not part of the key, and the claims must hold under it; inline align
    is the shared run's). Returns method -> the align stage's stats, and the SFT stats."""
    home, reference_vocab = tiny_run.home, tiny_run.reference_vocab
    two = ["align.launch.backend=accelerate", "align.launch.processes=2"]
    for method, launch in (("grpo", two), ("dpo", two), ("ppo", two)):
        gristmill(home, "run", "configs/tiny.yaml", reference_vocab, f"align.method={method}", *launch,
                  "--until", "align", timeout=1800, services=prefect_server)
    manifests = {stage: [json.loads(p.read_text()) for p in (home / "artifacts" / stage).glob("*/manifest.json")]
                 for stage in ("sft", "align")}
    preset_steps = load_config(REPO / "configs" / "tiny.yaml").sft.max_steps  # not the shared run's
    sft = next(m for m in manifests["sft"] if m["config"]["max_steps"] == preset_steps)
    aligned = [m for m in manifests["align"] if m["upstream"]["sft"] == sft["key"]]
    assert {m["config"]["method"]: m["meta"]["launch"]["world_size"] for m in aligned} == \
        {"grpo": 2, "dpo": 2, "ppo": 2}
    return {**{m["config"]["method"]: m["stats"] for m in aligned}, "sft": sft["stats"]}


# Thresholds sit below the smallest gain measured over five seeds of each method on the tiny
# preset's SFT model (Muon-pretrained base, 1,200 SFT steps): `gristmill run configs/tiny.yaml --until
# sft`, then `python -m bench claims --seeds 0,1,2,3,4` (2026-12-03, 2-core machine). Each compares the
# aligned model with a "before" the stage measured on the same held-out data, never a constant.

def test_sft_lowers_heldout_assistant_loss_and_keeps_its_language(tiny_preset_methods):
    """Validation-text loss, measured by the SFT stage on 16 val windows: with pretraining text
    mixed in (sft.pretrain_mix 0.25), 1200 steps continue pretraining as they teach the answers:
    on the Muon-pretrained base 4.573 -> 4.525, 4.535, 4.536 nats (sft.seed 0-2; held-out answer
    loss 5.55, 5.56, 5.48 -> 0.27, 0.28, 0.26), where arithmetic alone took the evaluate stage's
    perplexity from 335 to 2.6M (AdamW base). Asked: no rise."""
    sft = tiny_preset_methods["sft"]
    assert sft["heldout_loss_after"] < 0.5 * sft["heldout_loss_before"]
    assert sft["val_text_loss_after"] <= sft["val_text_loss_before"]


def test_grpo_raises_heldout_verifiable_accuracy(tiny_preset_methods):
    """186 held-out problems, greedy. Gains over seeds 0-4: accuracy +0.091, +0.097, +0.118,
    +0.075, +0.108 (before 0.091); answer format +0.608, +0.629, +0.672, +0.608, +0.645 (before
    0.306). On the AdamW base whole-pipeline reruns (each with its own SFT model) gave accuracy
    gains as low as +0.04, hence 0.03; the format gain carries the stronger evidence."""
    grpo = tiny_preset_methods["grpo"]
    assert grpo["heldout_accuracy_after"] >= grpo["heldout_accuracy_before"] + 0.03
    assert grpo["heldout_format_after"] >= grpo["heldout_format_before"] + 0.3


MARGIN_NATS = 1.0  # DPO's held-out log-prob margin gain asked for; the smallest seen is in the docstring


def test_dpo_raises_the_sft_models_heldout_preference(tiny_preset_methods):
    """How strongly the model prefers the chosen reply on 174 held-out pairs: the SFT model's
    measured log-prob margin (nats, chosen minus rejected) and accuracy before, the DPO model's
    after. Margin gains over DPO seeds 0-4: +8.03, +8.17, +6.83, +6.54, +9.75 nats (on the AdamW
    base +4.01 to +5.95). The accuracy saturates: whole-pipeline reruns differ in their
    SFT model, and one in CI already preferred the chosen (shorter, committed) reply on 0.874 of the
    pairs (DPO: 0.891), so the accuracy is only required not to fall; locally it rose
    0.40-0.53 -> 0.82-0.90."""
    dpo = tiny_preset_methods["dpo"]
    assert dpo["pairs_heldout"] >= 150
    assert dpo["heldout_logp_margin_after"] >= dpo["heldout_logp_margin_before"] + MARGIN_NATS
    assert dpo["heldout_logp_acc_after"] >= dpo["heldout_logp_acc_before"]


def test_reward_model_beats_random_heads_and_ppo_raises_its_score(tiny_preset_methods):
    """139 held-out pairs. The reward model's accuracy after training against untrained heads:
    the mean over 32 random heads (gains +0.20, +0.29, +0.31, +0.26, +0.30 over seeds 0-4; on
    the AdamW base +0.24 to +0.31, and +0.29 in a fresh-clone CI run: 0.460 -> 0.748). The one
    head this run drew is recorded (`heldout_rm_accuracy_before`) but not asserted on: half the demo
    pairs reject a hedge, which a random head ranks all one way, so a single head's accuracy swings
    with the seed (0.29-0.70 over seeds 0-4; 0.777 in that CI run, above its trained model's
    0.748); the mean over heads is the baseline with the statistical weight. The reward-model score
    of greedy replies to held-out prompts, PPO policy against the SFT model: +2.26, +2.35, +2.21,
    +2.26, +2.27 (on the AdamW base +2.26 to +2.67)."""
    ppo = tiny_preset_methods["ppo"]
    assert ppo["rm_pairs_heldout"] >= 130
    assert ppo["heldout_rm_accuracy_after"] >= ppo["heldout_rm_accuracy_untrained_mean"] + 0.12
    assert ppo["heldout_rm_score_after"] >= ppo["heldout_rm_score_before"] + 1.2
