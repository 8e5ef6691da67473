"""The collect stage's funnel: every record's fate, counted in total and per source, and samples
of what each step removed, kept for review.

Record-level events (read, extracted, URL, language, heuristic filters, decontamination, the score
of a quality model trained before) come from the work units; corpus-level steps (exact dedup, a
quality model trained on the crawl, near dedup, mixing) are added by the stage as it applies them.
`report()` is `funnel.json`: the steps in order with documents and bytes after each, reasons
grouped by kind, languages, per-source counts, and `accounting`.

Accounting (`Funnel.accounting`, checked by `check_accounting`): every record read is accounted for,
in total and per source,

    in = kept + dropped + quarantined

- in: records read, i.e. every event a reader yielded for one record (a document, a non-document
  record such as a WARC request or an image, an undecodable line, a binary payload) up to the
  `max_docs_per_source` cap. Not in it: FILE_LEVEL_ERRORS (an empty, truncated or corrupt file or
  stretch: whatever records it held could not be read, so they cannot be counted) and
  `error_source_without_documents`; they are listed apart, under `file_level`.
- kept: distinct documents in the output (a document the mix repeats counts once; `docs_out`
  counts the repeats).
- dropped: by reason, every record that is neither kept nor quarantined: record-level drops
  (`dropped_*` of the cleaning chain and decontamination, `skipped_*` non-documents) and
  corpus-level ones (exact and near duplicates, quality model, and `dropped_not_in_mix` for
  documents the mix did not take).
- quarantined: by reason, records whose event carries a sample for review/quarantine.jsonl
  (`error_*` per record, `skipped_binary`).
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gristmill.core.decontam import DROP_REASON as CONTAMINATED
from gristmill.tasks.collect.clean.quality_model import DROP_REASON as LOW_QUALITY
from gristmill.tasks.collect.output.spool import DocTable
from gristmill.tasks.collect.read.records import FILE_LEVEL_ERRORS

PREVIEW_CHARS = 500  # of a dropped document's text in review/dropped.jsonl


# Quarantined entries that stand for a source, not for a record (see the module docstring).
SOURCE_LEVEL_ERRORS = frozenset({"error_source_without_documents"})
NOT_IN_MIX = "dropped_not_in_mix"  # a document the mix did not take (weight < 1, budgets, cap)


class AccountingError(RuntimeError):
    """A bug guard: the funnel's numbers do not add up, so some step removed (or added) a document
    without counting it."""


def is_extracted(reason: str) -> bool:
    """Whether an event is a document that reached the cleaning chain."""
    return reason == "kept" or reason.startswith("dropped_")


def record_step(reason: str) -> str:
    """The record-level step a drop reason belongs to."""
    if reason == f"dropped_{CONTAMINATED}":
        return "decontamination"
    if reason == f"dropped_{LOW_QUALITY}":  # scored in the units by a model trained before
        return "quality_model"
    if reason.startswith("dropped_url"):
        return "url_filter"
    if reason.startswith("dropped_language"):
        return "language"
    return "quality_heuristics"


RECORD_STEPS = ("url_filter", "language", "quality_heuristics", "decontamination", "quality_model")


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
        # source -> "dropped" | "quarantined" -> reason -> records: the fate of every record read
        # that is not a kept document (see `accounting`)
        self.fates: dict[str, dict[str, Counter[str]]] = {}
        self._review_samples = review_samples

    def source(self, name: str) -> Counter[str]:
        return self.per_source.setdefault(name, Counter())

    def _fate(self, source: str, fate: str) -> Counter[str]:
        return self.fates.setdefault(source, {}).setdefault(fate, Counter())

    def add_event(self, source: str, event: dict[str, Any]) -> None:
        """One record's event from a work unit (see tasks.collect.stage.document_events)."""
        reason = event["reason"]
        for c in (self.counts, self.source(source)):
            c[reason] += 1
            c["bytes_in"] += event["nbytes"]
            c["records_read"] += reason not in FILE_LEVEL_ERRORS
            c["docs_in"] += is_extracted(reason)
        if reason != "kept" and reason not in FILE_LEVEL_ERRORS:
            self._fate(source, "quarantined" if "quarantine" in event else "dropped")[reason] += 1
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
            detail = {"matches": event["matches"][:10]} if "matches" in event else {}
            detail |= {"score": event["score"]} if "score" in event else {}
            self._sample(self.review, {"reason": reason, "source": source, "url": event.get("url"),
                                       **detail, "preview": event["preview"]}, reason)

    def drop_rows(self, reason: str, docs: DocTable, rows: np.ndarray,
                  detail: Callable[[int], dict[str, Any]] | None = None) -> None:
        """A corpus-level decision that removed the documents at `rows` of `docs` (reason already
        prefixed, e.g. dropped_...), counted per source; `detail(i)`: what the review sample of
        `rows[i]` says besides the document. Only the sampled documents are read."""
        if not len(rows):
            return
        counts = np.bincount(docs.source[rows], minlength=len(docs.sources))
        for code in np.flatnonzero(counts).tolist():
            source, n = docs.sources[code], int(counts[code])
            self.source(source)[reason] += n
            self._fate(source, "dropped")[reason] += n
        self.counts[reason] += len(rows)
        for i, row in enumerate(rows[:max(0, self._review_samples - self.counts[f"sampled_{reason}"])].tolist()):
            doc = docs.doc(row)
            self._sample(self.review, {"reason": reason, "source": doc["source"], "url": doc.get("url"),
                                       "id": doc["id"], **(detail(i) if detail else {}),
                                       "preview": doc["text"][:PREVIEW_CHARS]}, reason)

    def _sample(self, sink: list[dict[str, Any]], row: dict[str, Any], reason: str) -> None:
        key = f"sampled_{reason}"
        if self.counts[key] < self._review_samples:
            self.counts[key] += 1
            sink.append(row)

    def record_steps(self, decontaminated: bool = False, quality_scored: bool = False) -> None:
        """Append read → extracted → each record-level filter, from the event counts
        (decontamination and the quality model only when they ran in the units)."""
        docs, nbytes = self.counts["docs_in"], self.extracted_bytes
        self.step("records_read", self.counts["records_read"], self.counts["bytes_in"])
        self.step("extracted", docs, nbytes)
        skipped = {"decontamination": not decontaminated, "quality_model": not quality_scored}
        for step in (step for step in RECORD_STEPS if not skipped.get(step)):
            docs -= sum(n for k, n in self.counts.items()
                        if k.startswith("dropped_") and record_step(k) == step)
            nbytes -= self.dropped_bytes[step]
            self.step(step, docs, nbytes)

    def step(self, name: str, docs: int, nbytes: int) -> None:
        self.steps.append({"step": name, "docs": docs, "bytes": nbytes})

    def step_docs(self, name: str, docs: DocTable) -> None:
        self.step(name, len(docs), int(docs.text_bytes.sum()))

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

    def accounting(self, out_docs: DocTable) -> dict[str, Any]:
        """funnel.json's `accounting` block for the output documents `out_docs` (after the mix):
        in, kept, dropped and quarantined by reason, whether in = kept + dropped + quarantined
        holds, in total and per source (see the module docstring)."""
        order = np.lexsort((out_docs.hash_hi, out_docs.source))  # a document the mix repeats counts once
        source, ids = out_docs.source[order], out_docs.hash_hi[order]
        first = np.r_[True, (source[1:] != source[:-1]) | (ids[1:] != ids[:-1])][:len(order)]
        counts = np.bincount(source[first], minlength=len(out_docs.sources)).tolist()
        kept_by_name = {name: n for name, n in zip(out_docs.sources, counts) if n}
        sources = list(self.per_source) + [s for s in kept_by_name if s not in self.per_source]
        per_source = {s: _balance(self.source(s)["records_read"], kept_by_name.get(s, 0),
                                  self.fates.get(s, {})) for s in sources}
        totals: dict[str, Counter[str]] = {"dropped": Counter(), "quarantined": Counter()}
        for fates in self.fates.values():
            for fate, reasons in fates.items():
                totals[fate].update(reasons)
        block = _balance(self.counts["records_read"], sum(kept_by_name.values()), totals)
        block["balanced"] = block["balanced"] and all(b["balanced"] for b in per_source.values())
        return {**block, "docs_out": len(out_docs),
                "file_level": {k: v for k, v in sorted(self.counts.items())
                               if k in FILE_LEVEL_ERRORS or k in SOURCE_LEVEL_ERRORS},
                "per_source": per_source}

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


def _balance(n_in: int, kept: int, fates: dict[str, Counter[str]]) -> dict[str, Any]:
    dropped = dict(sorted(fates.get("dropped", Counter()).items()))
    quarantined = dict(sorted(fates.get("quarantined", Counter()).items()))
    n_dropped, n_quarantined = sum(dropped.values()), sum(quarantined.values())
    unaccounted = n_in - kept - n_dropped - n_quarantined  # > 0 lost, < 0 counted twice
    return {"in": n_in, "kept": kept, "dropped": dropped, "quarantined": quarantined,
            "unaccounted": unaccounted, "balanced": unaccounted == 0,
            "summary": f"in {n_in:,} = kept {kept:,} + dropped {n_dropped:,} + quarantined "
                       f"{n_quarantined:,}" + ("" if unaccounted == 0 else
                                               f" + unaccounted {unaccounted:,}")}


def check_accounting(accounting: dict[str, Any]) -> None:
    """AccountingError naming the numbers, in total and for each source that does not add up."""
    if accounting["balanced"]:
        return
    unbalanced = [f"{source!r}: {b['summary']}" for source, b in accounting["per_source"].items()
                  if not b["balanced"]]
    raise AccountingError(
        f"collect funnel does not add up: {accounting['summary']}"
        + (f"; by source: {'; '.join(unbalanced)}" if unbalanced else "")
        + ". Every record read must end kept, dropped with a reason or quarantined: a step "
          "removed or added documents without counting them (a bug; see funnel.json)")


def flatten(report: dict[str, Any]) -> dict[str, float]:
    """funnel.json → flat stats (reason keys already carry their kind prefix); the accounting
    block as accounting_{in,kept,dropped,quarantined,unaccounted}."""
    stats: dict[str, float] = {}  # counts, and the few shares the report holds
    accounting = report.get("accounting")
    if accounting:
        stats.update({f"accounting_{k}": v if isinstance(v, int) else sum(v.values())
                      for k, v in accounting.items()
                      if k in ("in", "kept", "dropped", "quarantined", "unaccounted")})
    for key, value in report.items():
        if isinstance(value, dict) and key not in ("per_source", "languages", "accounting"):
            stats.update(value)
        elif isinstance(value, (int, float)):
            stats[key] = value
    stats.update({f"docs_after_{s['step']}": s["docs"] for s in report["steps"]})
    stats["languages_detected"] = len(report["languages"])
    return stats
