"""Data gates: limits on what the collect stage removed, checked after it and before tokenize.

A cleaning step that misfires can remove nearly everything and still finish: fuzzy dedup has been
seen to collapse a whole source (859,092 documents → 2), and training went on with what was left.
A gate is a limit on a number the collect stage records (its funnel.json and stats):

    max_removed_fraction            per source: documents removed by all steps together / its documents
    max_removed_fraction_per_step   per step of the funnel: documents it removed / documents it was given
    max_reason_fraction             per source and drop reason: documents removed for it / its documents
    max_cluster_size                documents in the largest near-duplicate cluster
    min_kept_documents              documents in the output
    min_kept_tokens                 clean tokens in the output, estimated from its bytes

"Documents" of a source are those extracted from it (funnel `docs_in`: what reached the cleaning
chain); records that are not documents (a WARC request, an image) never count as removed. `check`
is a pure function of funnel.json and the stats: the tripped gates with their numbers, and the drop
reasons each concerns (for samples from review/dropped.jsonl). What happens when one trips (a
person approves or rejects) is the flow's business: flows/gates.py.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gristmill.tasks.collect.clean.quality_model import DROP_REASON as LOW_QUALITY
from gristmill.tasks.collect.output.funnel import NOT_IN_MIX, record_step

FIRST_STEP = "extracted"  # steps before it count records, not documents


class GatesConfig(BaseModel):
    """Limits on what collect removed, checked before tokenize; None turns a gate off. Not part of
    the collect artifact key: a gate changes no output, only whether a run goes on with it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_removed_fraction: float | None = Field(
        default=0.99, ge=0, le=1,
        description="Per source: the most of its documents (those extracted from it) that all steps together "
                    "may remove. A collapse (859,092 → 2) is 0.999998; the tiny preset removes 0.40, a web crawl "
                    "filtered to one language typically 0.8-0.9.")
    max_removed_fraction_per_step: float | None = Field(
        default=0.95, ge=0, le=1,
        description="Per funnel step after extraction (url_filter, language, quality_heuristics, decontamination, "
                    "exact_dedup, quality_model, near_dedup, mix): the most of the documents it is given that "
                    "it may remove. The tiny preset's largest is 0.31 (quality_heuristics).")
    max_reason_fraction: float | None = Field(
        default=0.9, ge=0, le=1,
        description="Per source and drop reason (near_duplicates, dropped_language_score_low...): the most of the "
                    "source's documents one reason may remove. The tiny preset's largest is 0.08.")
    max_cluster_size: int | None = Field(
        default=None, ge=2,
        description="The most documents one near-duplicate cluster may hold (its members from an earlier corpus "
                    "version's index included); the largest is the `near_dedup_largest_cluster` stat.")
    min_kept_documents: int | None = Field(
        default=None, ge=1,
        description="The fewest documents the output may hold (`docs_out`, a mix's repeats included).")
    min_kept_tokens: int | None = Field(
        default=None, ge=1,
        description="The fewest clean tokens the output may hold, estimated as its UTF-8 bytes / "
                    "refresh.bytes_per_token (no tokenizer exists before tokenize).")
    review_timeout_s: float = Field(
        default=86_400.0, gt=0,
        description="How long a run under a Prefect server waits, paused, for a person to approve or reject a "
                    "tripped gate; then it fails as rejected.")


@dataclass(frozen=True, kw_only=True)
class Trip:
    """One gate over its limit: `subject` says where (a source, a step, the corpus)."""

    gate: str  # a field of GatesConfig
    subject: str
    value: float
    limit: float
    numbers: str  # the counts behind `value`, for a person
    reasons: tuple[str, ...] = ()  # the drop reasons it concerns, most removals first
    source: str | None = None

    @property
    def id(self) -> str:
        """What an approval covers: the gate and where it tripped (not the limit: the numbers are
        those of one artifact, whatever limit made them trip)."""
        return f"{self.gate}[{self.subject}]"

    def describe(self, value: float) -> str:
        return f"{value:.1%}" if "fraction" in self.gate else f"{value:,.0f}"

    def line(self) -> str:
        """One line: `collect.gates.<gate>: <subject>: <value> > <limit> (<numbers>)`."""
        op = "<" if self.gate.startswith("min_") else ">"
        return (f"collect.gates.{self.gate}: {self.subject}: {self.describe(self.value)} {op} "
                f"{self.describe(self.limit)} ({self.numbers})")


def step_of(reason: str) -> str:
    """The funnel step a drop reason belongs to."""
    corpus = {"exact_duplicates": "exact_dedup", "near_duplicates": "near_dedup", NOT_IN_MIX: "mix",
              f"dropped_{LOW_QUALITY}": "quality_model"}
    return corpus.get(reason) or record_step(reason)


def is_removal(reason: str) -> bool:
    """Whether a reason removes a document (not a record that never was one: skipped_*, error_*)."""
    return reason.startswith("dropped_") or reason in ("exact_duplicates", "near_duplicates")


def _by_count(reasons: Mapping[str, int]) -> tuple[str, ...]:
    return tuple(r for r, _ in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])) if is_removal(r))


def _over(value: float, limit: float | None) -> bool:
    return limit is not None and value > limit


def _per_source(gates: GatesConfig, funnel: Mapping[str, Any]) -> Iterable[Trip]:
    """max_removed_fraction and max_reason_fraction, for each source that yielded documents."""
    accounting = funnel.get("accounting", {}).get("per_source", {})
    for source, counts in funnel.get("per_source", {}).items():
        docs = counts.get("docs_in", 0)
        if not docs or source not in accounting:
            continue
        kept, dropped = accounting[source]["kept"], accounting[source]["dropped"]
        removed = (docs - kept) / docs
        if (most := gates.max_removed_fraction) is not None and removed > most:
            yield Trip(gate="max_removed_fraction", subject=f"source {source!r}", value=removed,
                       limit=most, source=source, reasons=_by_count(dropped),
                       numbers=f"{docs:,} documents → {kept:,} kept")
        for reason in _by_count(dropped):
            share = dropped[reason] / docs
            if (most := gates.max_reason_fraction) is not None and share > most:
                yield Trip(gate="max_reason_fraction", subject=f"source {source!r}, {reason}", value=share,
                           limit=most, source=source, reasons=(reason,),
                           numbers=f"{dropped[reason]:,} of {docs:,} documents")


def _per_step(gates: GatesConfig, funnel: Mapping[str, Any]) -> Iterable[Trip]:
    steps: Sequence[Mapping[str, Any]] = funnel.get("steps", [])
    names = [s["step"] for s in steps]
    if gates.max_removed_fraction_per_step is None or FIRST_STEP not in names:
        return
    dropped = funnel.get("accounting", {}).get("dropped", {})
    for before, after in zip(steps[names.index(FIRST_STEP):], steps[names.index(FIRST_STEP) + 1:]):
        if not before["docs"]:
            continue
        removed = max(0, before["docs"] - after["docs"]) / before["docs"]
        if _over(removed, gates.max_removed_fraction_per_step):
            reasons = tuple(r for r in _by_count(dropped) if step_of(r) == after["step"])
            yield Trip(gate="max_removed_fraction_per_step", subject=f"step {after['step']}", value=removed,
                       limit=gates.max_removed_fraction_per_step, reasons=reasons,
                       numbers=f"{before['docs']:,} documents → {after['docs']:,}")


def _corpus(gates: GatesConfig, funnel: Mapping[str, Any], stats: Mapping[str, Any],
            bytes_per_token: float) -> Iterable[Trip]:
    top = _by_count(funnel.get("accounting", {}).get("dropped", {}))
    largest = stats.get("near_dedup_largest_cluster")  # absent: an artifact from before it was recorded
    if largest is not None and (most := gates.max_cluster_size) is not None and largest > most:
        yield Trip(gate="max_cluster_size", subject="near-duplicate clusters", value=largest,
                   limit=most, reasons=("near_duplicates",),
                   numbers=f"the largest holds {largest:,} documents, {largest - 1:,} removed as its duplicates")
    docs, nbytes = stats.get("docs_out", 0), stats.get("bytes_out", 0)
    if gates.min_kept_documents is not None and docs < gates.min_kept_documents:
        yield Trip(gate="min_kept_documents", subject="the output", value=docs, limit=gates.min_kept_documents,
                   reasons=top, numbers=f"{docs:,} documents kept of {stats.get('docs_in', 0):,} extracted")
    tokens = nbytes / bytes_per_token
    if gates.min_kept_tokens is not None and tokens < gates.min_kept_tokens:
        yield Trip(gate="min_kept_tokens", subject="the output", value=tokens, limit=gates.min_kept_tokens,
                   reasons=top, numbers=f"{nbytes:,} clean bytes / {bytes_per_token:g} bytes per token")


def check(gates: GatesConfig, funnel: Mapping[str, Any], stats: Mapping[str, Any],
          bytes_per_token: float) -> list[Trip]:
    """The gates of `gates` that the collect output described by `funnel` (its funnel.json) and
    `stats` (its manifest's stats) trips, in the order of the module docstring's table."""
    return [*_per_source(gates, funnel), *_per_step(gates, funnel), *_corpus(gates, funnel, stats, bytes_per_token)]


def samples(trips: Sequence[Trip], dropped: Iterable[Mapping[str, Any]], per_reason: int = 2,
            reasons_per_trip: int = 3) -> list[Mapping[str, Any]]:
    """Rows of review/dropped.jsonl that show what the tripped gates removed: for each trip, up to
    `per_reason` of each of its first `reasons_per_trip` reasons (of its source, if it has one)."""
    rows = list(dropped)
    chosen: list[Mapping[str, Any]] = []
    for trip in trips:
        for reason in trip.reasons[:reasons_per_trip]:
            matching = [r for r in rows if r.get("reason") == reason
                        and (trip.source is None or r.get("source") == trip.source) and r not in chosen]
            chosen += matching[:per_reason]
    return chosen
