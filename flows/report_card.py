"""The report card of a pipeline run: Markdown and one self-contained HTML file (charts embedded).

Built only from the run's committed manifests and the files they list, after the run or at any
time later (`gristmill report [RUN]`), so it can be regenerated for a past run and never changes
an artifact. What it shows, top to bottom: base → SFT → aligned for every score the evaluate
stage recorded; the align stage's own held-out before/after; training curves (pretrain loss and
val loss, SFT loss and held-out loss, alignment reward/KL or margins); the data funnel; tokenizer
compression; time per stage (computed or reused); and the lineage (the artifact keys that
produced the model).
"""
from __future__ import annotations

import base64
import html
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gristmill.core.stage import METRICS_FILE, Manifest, read_metrics
from gristmill.flows.registry import lower_is_better
from gristmill.flows.reports import FUNNEL, funnel_markdown
from gristmill.flows.stages import COLLECT, EVALUATE, PRETRAIN, STAGES, TOKENIZE
from gristmill.infra.charts import curves_chart, funnel_chart
from gristmill.tasks.evaluate.config import COMPRESSION_PREFIX, MODEL_LABELS


@dataclass(kw_only=True)
class Section:
    title: str
    rows: list[list[str]] = field(default_factory=list)  # the first row is the header
    notes: list[str] = field(default_factory=list)  # Markdown paragraphs
    chart: Path | None = None


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4f}"


def scores(stats: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """metric -> {model label -> value} from the evaluate stage's flat stats."""
    table: dict[str, dict[str, float]] = {}
    for key, value in stats.items():
        label, _, metric = key.partition("_")
        if label in MODEL_LABELS and metric and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            table.setdefault(metric, {})[label] = float(value)
    return dict(sorted(table.items()))


def _scores_section(evaluate: Manifest) -> Section:
    table = scores(evaluate.stats)
    labels = [label for label in MODEL_LABELS if any(label in v for v in table.values())]
    rows = [["metric", *labels, f"{labels[0]} → {labels[-1]}" if labels else "change"]]
    for metric, values in table.items():
        arrow = " ↓" if lower_is_better(metric) else ""
        first, last = values.get(labels[0]), values.get(labels[-1])
        change = f"{last - first:+.4g}" if first is not None and last is not None else ""
        rows.append([metric + arrow, *[_fmt(values[label]) if label in values else "—"
                                        for label in labels], change])
    return Section(title="Scores: base → SFT → aligned", rows=rows,
                   notes=["↓: lower is better. `<task>_contaminated`: items found in the model's "
                    "training data; `<task>_acc_clean`: accuracy on the others. Every number comes "
                    "from the evaluate stage "
                    f"(`evaluate-{evaluate.key}`), measured on the same items for each model."])


COMPRESSORS = {"xz": "xz -9e", "zstd": "zstd -22"}


def _compression_section(evaluate: Manifest, pretrain: Manifest | None) -> Section | None:
    """Each model's val_bpb beside general-purpose compressors on the same bytes: the baseline that
    says whether pretraining learned more than xz finds by reading the training text."""
    got = {k.removeprefix(COMPRESSION_PREFIX): v for k, v in evaluate.stats.items()
           if k.startswith(COMPRESSION_PREFIX)}
    if "scored_bytes" not in got:
        return None
    train_mb = got["train_bytes"] / 2**20
    rows = [["predictor", "bits per byte ↓"]]
    rows += [[f"{label} model", _fmt(evaluate.stats[f"{label}_val_bpb"])] for label in MODEL_LABELS
             if f"{label}_val_bpb" in evaluate.stats]
    for name, shown in COMPRESSORS.items():
        rows.append([f"{shown}, alone", _fmt(got[f"{name}_bpb"])])
        if f"{name}_given_train_bpb" in got:
            rows.append([f"{shown}, given {train_mb:.1f} MiB of training text", _fmt(got[f"{name}_given_train_bpb"])])
    notes = [f"On the {int(got['scored_bytes']):,} bytes of validation text the models' val_bpb scores. "
             "Given the training text: compress(train + val) − compress(train)."]
    if pretrain is not None and "flops" in pretrain.stats:
        trained = pretrain.stats
        notes.append(f"Pretraining compute: {trained['flops']:.3g} FLOPs "
                     f"({trained['flops_per_token']:.3g} per token × {trained['tokens_seen']:,} tokens).")
    return Section(title="Bits per byte against compressors", rows=rows, notes=notes)


def _alignment_section(evaluate: Manifest) -> Section | None:
    """The align stage's own held-out before/after, as the evaluate stage summarised it."""
    results = evaluate.path / "results.json"
    summary = json.loads(results.read_text()).get("alignment") if results.is_file() else None
    if not summary:
        return None
    rows = [["metric", "before (SFT)", "after (aligned)", "change"]]
    rows += [[m.replace("_", " "), _fmt(v["before"]), _fmt(v["after"]),
              f"{v['after'] - v['before']:+.4f}"] for m, v in summary["heldout"].items()]
    counts = ", ".join(f"{summary[k]} {k.replace('_', ' ')}" for k in
                       ("pairs_heldout", "prompts_heldout", "steps") if k in summary)
    return Section(title=f"Alignment ({summary['method']}), measured by the align stage on held-out data",
                   rows=rows, notes=[f"Measured on {counts}."] if counts else [])


def _curves(manifests: Mapping[str, Manifest]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for spec in STAGES:  # a training stage's entry names the step-metric columns worth a curve
        if not spec.curves or spec.name not in manifests:
            continue
        for row in read_metrics(manifests[spec.name].path / METRICS_FILE):
            for column, value in row.items():
                if column != "step" and any(w in column for w in spec.curves) \
                        and isinstance(value, (int, float)):
                    series.setdefault(spec.name, {}).setdefault(column, []).append((int(row["step"]), value))
    return series


def _curves_title(manifests: Mapping[str, Manifest], series: Mapping) -> str:
    """Named by the stages' keys, not the run: the same stages give the same chart (cached)."""
    return "training curves (" + ", ".join(f"{stage} {manifests[stage].key}" for stage in series) + ")"


def _funnel_section(collect: Manifest, charts: Path) -> Section | None:
    path = collect.path / FUNNEL
    if not path.is_file():
        return None
    funnel = json.loads(path.read_text())
    chart = funnel_chart(funnel["steps"], charts / "funnel.png", f"collect funnel ({collect.key})")
    return Section(title="Data funnel", notes=[funnel_markdown(funnel)], chart=chart)


def _tokenizer_section(tokenize: Manifest) -> Section:
    keys = ("vocab_size", "bytes_per_token", "reference_bytes_per_token",
            "compression_vs_reference", "train_tokens", "val_tokens")
    rows = [["measure", "value"]] + [[k.replace("_", " "), _fmt(tokenize.stats[k])]
                                     for k in keys if k in tokenize.stats]
    return Section(title="Tokenizer", rows=rows,
                   notes=["Compression: UTF-8 bytes per token on the validation split (higher packs "
                          "more text into each token)."])


def _time_and_lineage(manifests: Mapping[str, Manifest], statuses: Mapping[str, str]) -> list[Section]:
    time_rows = [["stage", "status", "seconds", "peak RSS (MB)"]]
    lineage = [["stage", "artifact key", "built from", "code version"]]
    for stage, m in manifests.items():
        rss = m.stats.get("peak_rss_mb")
        seconds = m.meta.get("seconds")
        time_rows.append([stage, statuses.get(stage, "?"), f"{seconds:.1f}" if seconds else "—",
                          _fmt(rss) if rss is not None else "—"])
        lineage.append([stage, f"{stage}-{m.key}",
                        ", ".join(f"{u}-{k}" for u, k in m.upstream.items()) or "its sources",
                        str(m.meta.get("code_version", ""))])
    total = sum(float(m.meta.get("seconds", 0)) for s, m in manifests.items()
                if statuses.get(s) == "computed")
    return [Section(title="Time per stage", rows=time_rows,
                    notes=[f"Computed in this run: {total:.1f} s (reused stages cost nothing)."]),
            Section(title="Lineage", rows=lineage)]


def build(manifests: Mapping[str, Manifest], statuses: Mapping[str, str], title: str,
          charts: Path, extra: list[Section] | None = None) -> list[Section]:
    """The report card's sections; charts are written into `charts` (PNG)."""
    sections: list[Section] = []
    if evaluate := manifests.get(EVALUATE.name):
        sections.append(_scores_section(evaluate))
        if bpb := _compression_section(evaluate, manifests.get(PRETRAIN.name)):
            sections.append(bpb)
        if aligned := _alignment_section(evaluate):
            sections.append(aligned)
    sections += extra or []
    if series := _curves(manifests):
        sections.append(Section(title="Training curves",
                                chart=curves_chart(series, charts / "curves.png", _curves_title(manifests, series))))
    if COLLECT.name in manifests and (funnel := _funnel_section(manifests[COLLECT.name], charts)):
        sections.append(funnel)
    if TOKENIZE.name in manifests:
        sections.append(_tokenizer_section(manifests[TOKENIZE.name]))
    return sections + _time_and_lineage(manifests, statuses)


def _md_table(rows: list[list[str]]) -> list[str]:
    cells = [[c.replace("|", "\\|") for c in row] for row in rows]
    return ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0]),
            *["| " + " | ".join(r) + " |" for r in cells[1:]]]


def to_markdown(title: str, sections: list[Section]) -> str:
    lines = [f"# {title}"]
    for s in sections:
        lines += ["", f"## {s.title}"]
        lines += ["", *_md_table(s.rows)] if s.rows else []
        lines += [line for note in s.notes for line in ("", note)]
        lines += ["", f"Chart: `{s.chart.name}` (embedded in report_card.html)."] if s.chart else []
    return "\n".join(lines) + "\n"


_STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
          "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
          "padding:.25em .6em;text-align:right}td:first-child,th:first-child{text-align:left}"
          "th{background:#f3f3f3}img{max-width:100%}pre{white-space:pre-wrap}")


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                   for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html_note(note: str) -> str:
    """A note's Markdown tables as HTML tables, the rest as preformatted text."""
    parts, table = [], []
    for line in [*note.splitlines(), ""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                table.append([c.strip() for c in line.strip("|").split("|")])
            continue
        if table:
            parts.append(_html_table(table))
            table = []
        if line.strip():
            parts.append(f"<p>{html.escape(line.replace('**', ''))}</p>")
    return "".join(parts)


def to_html(title: str, sections: list[Section]) -> str:
    """One file, nothing to fetch: charts are inlined as base64 PNG."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    for s in sections:
        body.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.rows:
            body.append(_html_table(s.rows))
        body += [_html_note(note) for note in s.notes]
        if s.chart:
            data = base64.b64encode(s.chart.read_bytes()).decode()
            body.append(f'<img alt="{html.escape(s.chart.stem)}" src="data:image/png;base64,{data}">')
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n")


def registry_section(note: str) -> Section:
    """The model registry's decision for this run (flows/registry.py)."""
    return Section(title="Model registry", notes=[note])


def write(manifests: Mapping[str, Manifest], statuses: Mapping[str, str], title: str,
          out_dir: Path, extra: list[Section] | None = None) -> tuple[Path, Path]:
    """Write report_card.md and report_card.html into `out_dir`; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sections = build(manifests, statuses, title, Path(tmp), extra)
        (out_dir / "report_card.html").write_text(to_html(title, sections))
    (out_dir / "report_card.md").write_text(to_markdown(title, sections))
    return out_dir / "report_card.md", out_dir / "report_card.html"
