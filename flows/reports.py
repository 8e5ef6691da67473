"""What a finished stage shows beyond its stats: charts in its MLflow run, Prefect artifacts.

Rendered from the committed artifact (never written into it, so a re-run changes no file). The
Prefect artifacts are made for computed and reused stages alike; the charts go to the MLflow run
that computed the stage (a reused stage's run points at it, unless it back-fills). One publisher per
stage that has something to show, named by the stage's entry in flows/stages.py.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from core.stage import Manifest
from infra.charts import funnel_chart, histogram_chart
from infra.tracking.runs import Tracker

FUNNEL = "funnel.json"


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


def publish_collect(manifest: Manifest, tracker: Tracker, run_id: str, charts: bool) -> None:
    """Funnel chart + language histogram (PNG) into MLflow run `run_id` when `charts` (a reused
    stage names the run that computed it, which has them); the tables in Prefect."""
    path = manifest.path / FUNNEL
    if not path.is_file():
        return
    funnel = json.loads(path.read_text())
    if charts:
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
