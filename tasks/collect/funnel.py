"""The collect stage's funnel: every record's fate, counted in total and per source, and samples
of what each step removed, kept for review.

Record-level events (read, extracted, URL, language, heuristic filters) come from the work units;
corpus-level steps (quality model, exact and near dedup, decontamination, mixing) are added by
the stage as it applies them. `report()` is `funnel.json`: the steps in order with documents and
bytes after each, reasons grouped by kind, languages, and per-source counts.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from tasks.collect.records import FILE_LEVEL_ERRORS

PREVIEW_CHARS = 500  # of a dropped document's text in review/dropped.jsonl
Doc = dict[str, Any]  # {"id", "text", "source", "url", "language"}


def is_extracted(reason: str) -> bool:
    """Whether an event is a document that reached the cleaning chain."""
    return reason == "kept" or reason.startswith("dropped_")


def record_step(reason: str) -> str:
    """The record-level step a drop reason belongs to."""
    if reason.startswith("dropped_url"):
        return "url_filter"
    if reason.startswith("dropped_language"):
        return "language"
    return "quality_heuristics"


RECORD_STEPS = ("url_filter", "language", "quality_heuristics")


def text_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


class Funnel:
    """Counts of every decision, the kept documents so far, and review samples."""

    def __init__(self, review_samples: int) -> None:
        self.counts: Counter[str] = Counter()
        self.per_source: dict[str, Counter[str]] = {}
        self.languages: Counter[str] = Counter()
        self.dropped_bytes: Counter[str] = Counter()  # record step -> extracted text bytes removed
        self.extracted_bytes = 0
        self.steps: list[dict[str, Any]] = []
        self.review: list[dict[str, Any]] = []
        self.quarantine: list[dict[str, Any]] = []
        self._review_samples = review_samples

    def source(self, name: str) -> Counter[str]:
        return self.per_source.setdefault(name, Counter())

    def add_event(self, source: str, event: dict[str, Any]) -> None:
        """One record's event from a work unit (see tasks.collect.stage.document_event)."""
        reason = event["reason"]
        for c in (self.counts, self.source(source)):
            c[reason] += 1
            c["bytes_in"] += event["nbytes"]
            c["records_read"] += reason not in FILE_LEVEL_ERRORS
            c["docs_in"] += is_extracted(reason)
        if event.get("language"):
            self.languages[event["language"]] += 1
        for kind, n in event.get("pii", {}).items():
            self.counts[f"pii_{kind}"] += n
        self.extracted_bytes += event.get("text_bytes", 0)
        if reason.startswith("dropped_"):
            self.dropped_bytes[record_step(reason)] += event.get("text_bytes", 0)
        if "quarantine" in event:
            self._sample(self.quarantine, {**event["quarantine"], "source": source}, reason)
        if "preview" in event:
            self._sample(self.review, {"reason": reason, "source": source, "url": event.get("url"),
                                       "preview": event["preview"]}, reason)

    def drop(self, reason: str, doc: Doc, **detail: Any) -> None:
        """A corpus-level decision that removed `doc` (reason already prefixed, e.g. dropped_...)."""
        for c in (self.counts, self.source(doc["source"])):
            c[reason] += 1
        self._sample(self.review, {"reason": reason, "source": doc["source"], "url": doc.get("url"),
                                   "id": doc["id"], **detail, "preview": doc["text"][:PREVIEW_CHARS]},
                     reason)

    def _sample(self, sink: list[dict[str, Any]], row: dict[str, Any], reason: str) -> None:
        key = f"sampled_{reason}"
        if self.counts[key] < self._review_samples:
            self.counts[key] += 1
            sink.append(row)

    def record_steps(self) -> None:
        """Append read → extracted → each record-level filter, from the event counts."""
        docs, nbytes = self.counts["docs_in"], self.extracted_bytes
        self.step("records_read", self.counts["records_read"], self.counts["bytes_in"])
        self.step("extracted", docs, nbytes)
        for step in RECORD_STEPS:
            docs -= sum(n for k, n in self.counts.items()
                        if k.startswith("dropped_") and record_step(k) == step)
            nbytes -= self.dropped_bytes[step]
            self.step(step, docs, nbytes)

    def step(self, name: str, docs: int, nbytes: int) -> None:
        self.steps.append({"step": name, "docs": docs, "bytes": nbytes})

    def step_docs(self, name: str, docs: Iterable[Doc]) -> None:
        docs = list(docs)
        self.step(name, len(docs), sum(text_bytes(d["text"]) for d in docs))

    def report(self) -> dict[str, Any]:
        """funnel.json."""
        def group(prefix: str) -> dict[str, int]:
            return {k: v for k, v in sorted(self.counts.items()) if k.startswith(prefix)}

        return {
            "steps": self.steps,
            "records_read": self.counts["records_read"],
            "skipped": group("skipped_"),
            "errors": group("error_"),
            "docs_in": self.counts["docs_in"],
            "dropped": group("dropped_"),
            "pii_replaced": group("pii_"),
            "exact_duplicates": self.counts["exact_duplicates"],
            "near_duplicates": self.counts["near_duplicates"],
            "bytes_in": self.counts["bytes_in"],
            "languages": dict(self.languages.most_common()),
            "per_source": {s: dict(sorted(c.items())) for s, c in self.per_source.items()},
        }

    def write_review(self, review_dir: Path) -> list[str]:
        """review/dropped.jsonl and review/quarantine.jsonl; returns their names relative to the
        stage dir."""
        review_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name, rows in (("dropped.jsonl", self.review), ("quarantine.jsonl", self.quarantine)):
            (review_dir / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                   for r in rows))
            written.append(f"{review_dir.name}/{name}")
        return written


def flatten(report: dict[str, Any]) -> dict[str, int]:
    """funnel.json → flat stats (reason keys already carry their kind prefix)."""
    stats: dict[str, int] = {}
    for key, value in report.items():
        if isinstance(value, dict) and key not in ("per_source", "languages"):
            stats.update(value)
        elif isinstance(value, (int, float)):
            stats[key] = value
    stats.update({f"docs_after_{s['step']}": s["docs"] for s in report["steps"]})
    stats["languages_detected"] = len(report["languages"])
    return stats
