"""What a finished stage shows beyond its stats: charts, logged models and the metrics of those
models in its MLflow run, Prefect artifacts.

Rendered from the committed artifact (never written into it, so a re-run changes no file). The
Prefect artifacts are made for computed and reused stages alike; what goes to MLflow goes to the
run that computed the stage (a reused stage's run points at it, unless it back-fills: the
publisher's `owner`). One publisher per stage that has something to show, named by the stage's
entry in flows/stages.py.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from prefect.artifacts import create_markdown_artifact

import gristmill.core.arithmetic as arithmetic
from gristmill.core.sources import JSONL_SUFFIXES, input_digest, source_files
from gristmill.core.stage import Manifest
from gristmill.infra.charts import funnel_chart, histogram_chart
from gristmill.infra.tracking.models import EvalData, chat_model, log_model_metrics, logged_model
from gristmill.infra.tracking.runs import Tracker, dataset_name
from gristmill.tasks.evaluate.formats import task_name

FUNNEL = "funnel.json"
EVALUATED = {"sft": "sft", "aligned": "align"}  # evaluate's label of a logged model -> its stage


def funnel_markdown(funnel: dict) -> str:
    """The funnel as Markdown: the accounting line (every record read, where it ended), documents
    and MB after each step, drop reasons, languages, and each source that had quarantined files."""
    accounting = funnel.get("accounting")
    rows = [f"**Records:** {accounting['summary']}"
            f"{'' if accounting['balanced'] else ' — does not add up'}", ""] if accounting else []
    rows += ["| step | documents | MB | kept of previous |", "|---|---:|---:|---:|"]
    previous = None
    for step in funnel["steps"]:
        share = f"{step['docs'] / previous:.1%}" if previous else ""
        rows.append(f"| {step['step']} | {step['docs']:,} | {step['bytes'] / 1e6:,.2f} | {share} |")
        previous = step["docs"] or None
    # The accounting's reasons include the dedup removals; older funnels lack it.
    drops = (accounting or {}).get("dropped") or {
        **funnel.get("dropped", {}), **funnel.get("skipped", {}), **funnel.get("errors", {})}
    if drops:
        rows += ["", "| reason | records |", "|---|---:|"]
        rows += [f"| {k} | {v:,} |" for k, v in sorted(drops.items(), key=lambda kv: -kv[1])]
    languages = funnel.get("languages", {})
    if languages:
        rows += ["", "| language | documents |", "|---|---:|"]
        rows += [f"| {k} | {v:,} |" for k, v in sorted(languages.items(), key=lambda kv: -kv[1])]
    faulty = {s: b for s, b in (accounting or {}).get("per_source", {}).items() if b["quarantined"]}
    if faulty:
        rows += ["", "| source | accounting | quarantined |", "|---|---|---|"]
        rows += [f"| {s} | {b['summary']} | {', '.join(f'{k} {v}' for k, v in b['quarantined'].items())} |"
                 for s, b in faulty.items()]
    return "\n".join(rows)


def publish_collect(manifest: Manifest, tracker: Tracker, run_id: str, owner: bool) -> None:
    """Funnel chart + language histogram (PNG) into MLflow run `run_id` when it is the `owner` (a
    reused stage names the run that computed it, which has them); the tables in Prefect."""
    path = manifest.path / FUNNEL
    if not path.is_file():
        return
    funnel = json.loads(path.read_text())
    if owner:
        with tempfile.TemporaryDirectory() as tmp:
            pngs = [funnel_chart(funnel["steps"], Path(tmp) / "funnel.png", f"collect funnel ({manifest.key})")]
            if funnel.get("languages"):
                pngs.append(histogram_chart(funnel["languages"], Path(tmp) / "languages.png",
                                            "documents per detected language (before filtering)"))
            for png in pngs:
                tracker.log_file(run_id, png, "charts")
    create_markdown_artifact(
        f"## Collect funnel `{manifest.key}`\n\nCharts: MLflow run `{run_id}`, "
        f"`charts/funnel.png` and `charts/languages.png`.\n\n{funnel_markdown(funnel)}",
        key="collect-funnel", description="Documents and bytes after each cleaning step")


def publish_model(manifest: Manifest, tracker: Tracker, run_id: str, owner: bool) -> None:
    """The stage's `model/` as an MLflow logged model of run `run_id` (infra/tracking/models.py),
    unless one is logged already: for a reused stage, one search. Not only the `owner` logs: an
    artifact computed before models were logged gets its model logged by the next run using it."""
    chat_model(tracker, run_id, manifest)


def publish_evaluate(manifest: Manifest, tracker: Tracker, run_id: str, owner: bool) -> None:
    """The SFT and aligned models' scores, logged into run `run_id` (when it is the `owner`) against
    their logged models and the data each was measured on."""
    if owner:
        for label, stage in EVALUATED.items():
            log_model_metrics(tracker, run_id, logged_model(tracker, stage, manifest.upstream[stage]),
                              measured_on(manifest, label))


def measured_on(evaluate: Manifest, label: str) -> list[tuple[EvalData | None, dict[str, float]]]:
    """The evaluate stage's scores of model `label` (its stats `<label>_<metric>`), grouped by the
    data they were measured on: `val_*` the tokenize stage's val split (that artifact, in the
    run's lineage), `arith_*` the generated test problems, `<task>_*` each benchmark file; the
    rest (`core`: a mean over the tasks) on no one of them."""
    config, tokenize = evaluate.config, evaluate.upstream["tokenize"]
    problems = arithmetic.problems("test", config["arith_problems"], config["arith_seed"])
    data = {"val": EvalData(name=dataset_name("tokenize", tokenize), digest=tokenize),
            "arith": EvalData(name="arithmetic-test", digest=_digest([[p.question, p.answer] for p in problems]),
                              source=f"gristmill.core.arithmetic?split=test&n={len(problems)}&seed={config['arith_seed']}",
                              source_type="gristmill-generated")}
    for path in config["tasks"]:
        name = task_name(Path(path))
        data[name] = EvalData(name=name, digest=_digest(input_digest(path)), source_type="gristmill-benchmark",
                              source=str(source_files(path, JSONL_SUFFIXES)[0]))
    longest_first = sorted(data, key=len, reverse=True)  # a task named after another's prefix
    groups: dict[str | None, dict[str, float]] = {}
    for key, value in evaluate.stats.items():
        if key.startswith(f"{label}_"):
            metric = key.removeprefix(f"{label}_")
            group = next((name for name in longest_first if metric.startswith(f"{name}_")), None)
            groups.setdefault(group, {})[key] = value
    return [(data[group] if group else None, metrics) for group, metrics in groups.items()]


def _digest(content: object) -> str:
    """A dataset digest: sha256 of `content` as JSON, 12 hex digits (as artifact keys)."""
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()[:12]
