"""The report card (Markdown + self-contained HTML), `gristmill report` and `gristmill compare`:
unit tests on hand-made manifests, then the shared tiny run's real card."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import REPO, STAGES, cli_env, gristmill

from gristmill.core.stage import Manifest
from gristmill.flows import report_card


def _manifest(tmp_path: Path, stage: str, stats: dict, metrics: list[dict] | None = None,
              upstream: dict | None = None) -> Manifest:
    path = tmp_path / stage
    path.mkdir()
    if metrics:
        (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return Manifest(stage=stage, key=f"{stage[:3]}000000001", path=path, config={},
                    upstream=upstream or {}, files={}, stats=stats, meta={"seconds": 1.5})


def test_scores_table_puts_each_models_value_under_its_column(tmp_path):
    evaluate = _manifest(tmp_path, "evaluate", {
        "base_val_ppl": 300.0, "sft_val_ppl": 350.0, "aligned_val_ppl": 360.0,
        "base_arith_acc": 0.0, "sft_arith_acc": 0.2, "aligned_arith_acc": 0.5,
        "aligned_hellaswag_acc": 0.25, "device": "cpu"}, upstream={"align": "ali000000001"})
    (evaluate.path / "results.json").write_text(json.dumps({"alignment": {
        "method": "grpo", "prompts_heldout": 186, "heldout": {"acc": {"before": 0.2, "after": 0.5}}}}))
    align = _manifest(tmp_path, "align", {"method": "grpo"},
                      [{"step": 1, "reward": 0.1, "kl": 0.0, "lr": 1e-4},
                       {"step": 2, "reward": 0.3, "kl": 0.01, "lr": 1e-4}])
    sections = report_card.build({"align": align, "evaluate": evaluate},
                                 {"align": "computed", "evaluate": "reused"}, "t", tmp_path)
    md = report_card.to_markdown("t", sections)
    assert "| arith_acc | 0.0000 | 0.2000 | 0.5000 | +0.5 |" in md
    assert "| val_ppl ↓ | 300.00 | 350.00 | 360.00 | +60 |" in md
    assert "| hellaswag_acc | — | — | 0.2500 |  |" in md  # only measured where measured
    assert "| acc | 0.2000 | 0.5000 | +0.3000 |" in md  # the align stage's own before/after
    assert "## Alignment (grpo)" in md and "Measured on 186 prompts heldout." in md
    assert "| align | computed | 1.5 |" in md and "| evaluate | reused | 1.5 |" in md
    assert "evaluate-eva000000001 | align-ali000000001" in md
    html = report_card.to_html("t", sections)
    assert html.count("data:image/png;base64,") == 1  # the curves; no funnel without collect
    assert "<td>arith_acc</td><td>0.0000</td><td>0.2000</td><td>0.5000</td>" in html


@pytest.mark.slow
def test_the_tiny_runs_card_report_and_compare(tiny_run, prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    home = tiny_run.home
    # the shared run once more, now the latest run of this home, every stage reused (other tests
    # may have run other configurations here since)
    gristmill(home, "run", "configs/tiny.yaml", *tiny_run.overrides, services=prefect_server)
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    experiment = client.get_experiment_by_name("gristmill")
    parents = sorted(client.search_runs([experiment.experiment_id],
                                        "tags.`gristmill.kind` = 'pipeline'"),
                     key=lambda r: r.info.start_time)
    first, last = parents[0].info.run_id, parents[-1].info.run_id
    logged = Path(client.download_artifacts(first, "report_card.md", str(tmp_path)))
    card = logged.read_text()
    evaluate = json.loads(next((home / "artifacts" / "evaluate").glob("*/manifest.json")).read_text())
    stats = evaluate["stats"]
    row = re.search(r"^\| val_ppl ↓ \| (.+?) \| (.+?) \| (.+?) \|", card, re.M)
    assert [float(v.replace(",", "")) for v in row.groups()] == pytest.approx(
        [stats["base_val_ppl"], stats["sft_val_ppl"], stats["aligned_val_ppl"]], rel=1e-3)
    # val_bpb beside the compressors on the same bytes, and the pretraining compute
    for predictor, key in (("base model", "base_val_bpb"), ("aligned model", "aligned_val_bpb"),
                           ("xz -9e, alone", "compression_xz_bpb"), ("zstd -22, alone", "compression_zstd_bpb")):
        row = re.search(rf"^\| {predictor} \| ([0-9.]+) \|", card, re.M)
        assert float(row[1]) == pytest.approx(stats[key], abs=1e-4), predictor
    given = re.search(r"^\| xz -9e, given ([0-9.]+) MiB of training text \| ([0-9.]+) \|", card, re.M)
    assert float(given[1]) == pytest.approx(stats["compression_train_bytes"] / 2**20, abs=0.05)
    assert float(given[2]) == pytest.approx(stats["compression_xz_given_train_bpb"], abs=1e-4)
    # the evaluated base model's pretraining (another test pretrains the full preset in this home)
    pretrain_key = evaluate["upstream"]["pretrain"]
    pretrain = json.loads((home / "artifacts" / "pretrain" / f"pretrain-{pretrain_key}" / "manifest.json")
                          .read_text())["stats"]
    assert pretrain["flops"] == pretrain["flops_per_token"] * pretrain["tokens_seen"] > 0
    assert f"Pretraining compute: {pretrain['flops']:.3g} FLOPs" in card
    for task in ("hellaswag_val_part1", "arc_easy_part1"):  # each score with its contamination
        for metric in ("acc", "acc_clean", "contaminated", "centered_acc"):
            assert re.search(rf"^\| {task}_{metric} \| ", card, re.M), (task, metric)
    assert "**Model registry:** `gristmill-tiny` version 1: `candidate`, promoted to `champion` " \
           "(no champion yet)." in card  # the registry's decision, with its reason
    for section in ("Training curves", "Data funnel", "Tokenizer", "Time per stage", "Lineage"):
        assert f"## {section}" in card
    assert all(f"| {stage} | computed |" in card for stage in STAGES)
    html = (home / "reports" / first / "report_card.html").read_text()
    assert html.count("data:image/png;base64,") == 2
    # nothing to fetch: no link outside the embedded charts (whose base64 may spell "http" by chance)
    outside_charts = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)
    assert "http" not in outside_charts.replace("http-equiv", "")

    # `report RUN` rebuilds the same card from MLflow and the artifact store
    regenerated = gristmill(home, "report", first).stdout
    assert regenerated.startswith(card)
    # the default is the latest run: the re-run, which reused every stage
    assert all(f"| {stage} | reused |" in gristmill(home, "report").stdout for stage in STAGES)
    compared = gristmill(home, "compare", first, last).stdout
    assert "Same configuration." in compared
    for stage in STAGES:
        assert re.search(rf"^\| {stage} \| \w+ computed \| \w+ reused \| yes \|", compared, re.M), compared
    missing = subprocess.run([sys.executable, "-m", "gristmill", "report", "no-such-run"], cwd=REPO,
                             env=cli_env(home), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.strip() == \
        f"gristmill: no pipeline run 'no-such-run' in sqlite:///{home.resolve()}/mlflow.db"


def test_a_chart_is_rendered_once_and_then_copied_from_the_cache(tmp_path, monkeypatch):
    from gristmill.infra import charts

    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path / "home"))
    steps = [{"step": "read", "docs": 10, "bytes": 5e6}, {"step": "kept", "docs": 4, "bytes": 1e6}]
    first = charts.funnel_chart(steps, tmp_path / "a.png", "funnel")
    monkeypatch.setattr(charts, "_pyplot", lambda: (_ for _ in ()).throw(AssertionError("rendered again")))
    second = charts.funnel_chart(steps, tmp_path / "b.png", "funnel")
    assert first.read_bytes() == second.read_bytes() and first.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(AssertionError, match="rendered again"):  # other data: a new chart
        charts.funnel_chart(steps[:1], tmp_path / "c.png", "funnel")
