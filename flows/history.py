"""Past pipeline runs, read back from MLflow and the artifact store.

    gristmill report [RUN]         # the report card of RUN (MLflow run id or name; default: latest)
    gristmill compare RUN_A RUN_B  # what changed: config keys, stages reused vs computed, metrics

A pipeline run's MLflow parent run names its stage runs, and each stage run names the artifact key
it used; the artifact store holds the manifests, so a report card can be rebuilt at any time.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from gristmill.core.stage import Manifest
from gristmill.flows import report_card
from gristmill.flows.gates import GateDecision
from gristmill.flows.registry import Decision
from gristmill.flows.stages import STAGE_NAMES
from gristmill.infra import env
from gristmill.infra.artifacts import ArtifactStore, home_store
from gristmill.infra.tracking.runs import RunRecord, Tracker, pipeline_run, stage_runs_of

DAG_ORDER = {name: i for i, name in enumerate(STAGE_NAMES)}


def run_manifests(tracker: Tracker, store: ArtifactStore,
                  parent: Mapping) -> tuple[dict[str, Manifest], dict[str, str], list[str]]:
    """(stage -> manifest, stage -> 'computed' | 'reused', stages whose artifact is gone)."""
    manifests, statuses, missing = {}, {}, []
    for run in stage_runs_of(tracker, parent["run_id"]):
        stage, key = run["tags"].get("gristmill.stage"), run["tags"].get("gristmill.key")
        manifest = store.load(stage, key) if stage and key else None
        if manifest is None:
            missing.append(f"{stage}-{key}")
            continue
        manifests[stage] = manifest
        statuses[stage] = "reused" if run["tags"].get("gristmill.reused") == "true" else "computed"
    return manifests, statuses, missing


def publish_report_card(tracker: Tracker, home: Path, parent_id: str, run_name: str,
                        manifests: Mapping[str, Manifest], statuses: Mapping[str, str],
                        extra: list[report_card.Section] | None = None) -> tuple[Path, Path]:
    """Write the report card under GRISTMILL_HOME/reports/<run id>/ and attach it to the run."""
    paths = report_card.write(manifests, statuses, f"gristmill report card: {run_name}",
                              env.reports_root(home) / parent_id, extra)
    for path in paths:
        tracker.log_file(parent_id, path)
    return paths


def report(home: Path, run: str | None = None) -> tuple[Path, Path, list[str]]:
    """Regenerate the report card of a past run; also returns the stages whose artifact is gone."""
    tracker = Tracker(home)
    parent = pipeline_run(tracker, run)
    manifests, statuses, missing = run_manifests(tracker, home_store(home), parent)
    if not manifests:
        raise LookupError(f"run {parent['run_id']}: none of its stage artifacts is in "
                          f"{env.artifacts_root(home)} any more")
    notes = [report_card.Section(title="Missing artifacts", notes=[
        "Deleted from the artifact store since the run: " + ", ".join(missing)])] if missing else []
    if (gates := GateDecision.from_tags(parent["tags"])) and gates.outcome != "passed":
        notes.append(gates.section())
    if decision := Decision.from_tags(parent["tags"]):
        notes.append(report_card.registry_section(decision.markdown()))
    md, html = publish_report_card(tracker, home, parent["run_id"], parent["name"],
                                   manifests, statuses, notes)
    return md, html, missing


def _changes(a: Mapping[str, str], b: Mapping[str, str]) -> list[tuple[str, str, str]]:
    return [(k, a.get(k, "—"), b.get(k, "—")) for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


def _stage_rows(runs: list[RunRecord]) -> dict[str, RunRecord]:
    """stage -> its run, in the DAG's order (reused stages are recorded concurrently, so their
    runs' start times need not follow it)."""
    rows = {r["tags"].get("gristmill.stage", r["name"]): r for r in runs}
    return dict(sorted(rows.items(), key=lambda item: DAG_ORDER.get(item[0], len(DAG_ORDER))))


def compare(home: Path, run_a: str, run_b: str) -> str:
    """Markdown: config keys that differ, each stage's key and status in both runs, and the
    metrics of each stage run that differ (b − a)."""
    tracker = Tracker(home)
    a, b = pipeline_run(tracker, run_a), pipeline_run(tracker, run_b)
    lines = [f"# {a['name']} ({a['run_id'][:8]}) → {b['name']} ({b['run_id'][:8]})", "",
             "## Config", ""]
    config = _changes(a["params"], b["params"])
    lines += ["| key | A | B |", "|---|---|---|", *[f"| {k} | {x} | {y} |" for k, x, y in config]] \
        if config else ["Same configuration."]
    stages_a, stages_b = _stage_rows(stage_runs_of(tracker, a["run_id"])), \
        _stage_rows(stage_runs_of(tracker, b["run_id"]))
    lines += ["", "## Stages", "", "| stage | A | B | same artifact |", "|---|---|---|---|"]

    def status(run: RunRecord | None) -> str:
        if run is None:
            return "—"
        reused = run["tags"].get("gristmill.reused") == "true"
        return f"{run['tags'].get('gristmill.key')} {'reused' if reused else 'computed'}"

    for stage in dict.fromkeys([*stages_a, *stages_b]):
        ra, rb = stages_a.get(stage), stages_b.get(stage)
        same = ra is not None and rb is not None and \
            ra["tags"].get("gristmill.key") == rb["tags"].get("gristmill.key")
        lines.append(f"| {stage} | {status(ra)} | {status(rb)} | {'yes' if same else 'no'} |")
    lines += ["", "## Metrics that differ", "", "| stage | metric | A | B | B − A |", "|---|---|---:|---:|---:|"]
    differ = 0
    for stage in dict.fromkeys([*stages_a, *stages_b]):
        ma = (stages_a.get(stage) or {}).get("metrics", {})
        mb = (stages_b.get(stage) or {}).get("metrics", {})
        for name in sorted(ma.keys() & mb.keys()):
            if ma[name] != mb[name]:
                differ += 1
                lines.append(f"| {stage} | {name} | {ma[name]:.6g} | {mb[name]:.6g} | "
                             f"{mb[name] - ma[name]:+.4g} |")
    if not differ:
        lines.append("| | (none) | | | |")
    return "\n".join(lines) + "\n"
