"""Data gates in a run: the collect output's numbers checked against `collect.gates` after collect
and before tokenize (the check itself: tasks/collect/output/gates.py), and a person's decision when one trips.

When a gate trips, the first of these that applies decides:

1. an earlier approval of the same gates on the same collect artifact: the run goes on (a re-run,
   a Retry, a refresh or a pipeline reusing that artifact is not asked again);
2. `approve_gates` (`gristmill run|refresh --approve-gates`, or the deployment's parameter): approved;
3. a Prefect server a person can open (PREFECT_API_URL set: a served deployment, a worker, a CLI
   run against `gristmill up`'s servers): the run publishes the `collect-gates` Markdown artifact
   (the gates with their numbers, the funnel, samples of what was removed from review/) and pauses
   (`pause_flow_run` with a `GateReview` input). In the UI: the run's page → Resume → approve on or
   off, a comment → Submit. Approved, the run goes on; rejected (or no answer within
   `collect.gates.review_timeout_s`), it fails with the reason;
4. otherwise (the CLI's embedded Prefect, which has no UI): `GatesStopped`, which the CLI prints as
   one line naming the gate, exit 3.

Decisions are recorded in the artifact store beside the collect artifact
(`collect-<key>.gates.jsonl`: what a later run checks for an earlier approval), as MLflow tags on
the run (`gristmill.gates.*`), in the report card ("Data gates") and in Prefect (the artifact, the
run's log and input, a rejected run's Failed state). An approval covers a gate where it tripped (a
source, a step), whatever its limit: the numbers are those of the one artifact.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, cast, get_args

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from pydantic import Field

from gristmill.core.stage import Manifest
from gristmill.flows.report_card import Section
from gristmill.flows.reports import FUNNEL, funnel_markdown
from gristmill.flows.stages import COLLECT
from gristmill.infra.artifacts import ArtifactStore
from gristmill.infra.services import is_embedded_prefect
from gristmill.infra.tracking.runs import Tracker
from gristmill.tasks.collect.output.gates import GatesConfig, Trip, check, samples

ARTIFACT_KEY = f"{COLLECT.name}-gates"
TAG = "gristmill.gates."
APPROVE_FLAG = "approve_gates (--approve-gates)"
PREVIEW_CHARS = 300  # of each removed document shown
POLL_S = 2  # how often a paused run asks the server whether it was resumed (one small GET)

Outcome = Literal["passed", "approved", "rejected", "stopped"]


class GateReview(RunInput):
    """What a person answers on the paused run's Resume form."""

    approve: bool = Field(default=False, description="On: go on with this data. Off: reject it; the run fails "
                                                     "with your comment as the reason.")
    comment: str = Field(default="", description="Why; recorded in Prefect, MLflow and the report card.")


@dataclass(frozen=True, kw_only=True)
class GateDecision:
    """What happened at the gates of one run."""

    outcome: Outcome
    artifact: str  # collect-<key>
    trips: tuple[str, ...] = ()  # Trip.line() of each tripped gate
    by: str = ""  # who or what decided
    comment: str = ""
    at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def tags(self) -> dict[str, str]:
        values = {"outcome": self.outcome, "artifact": self.artifact, "tripped": "\n".join(self.trips),
                  "by": self.by, "comment": self.comment, "at": self.at}
        return {TAG + k: v[:5000] for k, v in values.items() if v}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> GateDecision | None:
        """The decision recorded on a run (`gristmill.gates.*` tags), if any."""
        got = {k.removeprefix(TAG): v for k, v in tags.items() if k.startswith(TAG)}
        if got.get("outcome") not in get_args(Outcome) or "artifact" not in got:
            return None
        return cls(outcome=cast(Outcome, got["outcome"]), artifact=got["artifact"],
                   trips=tuple(filter(None, got.get("tripped", "").split("\n"))), by=got.get("by", ""),
                   comment=got.get("comment", ""), at=got.get("at", ""))

    def markdown(self) -> str:
        if self.outcome == "passed":
            return f"**Data gates:** all passed on `{self.artifact}`."
        verdict = {"approved": "approved", "rejected": "rejected", "stopped": "stopped the run (no one to ask)"}
        said = f': "{self.comment}"' if self.comment else ""
        head = f"**Data gates:** {verdict[self.outcome]}" + (f" by {self.by}" if self.by else "") + \
            f" at {self.at}{said}. Tripped on `{self.artifact}`:"
        return "\n".join([head, "", *(f"- {line}" for line in self.trips)])

    def section(self) -> Section:
        return Section(title="Data gates", notes=[self.markdown()])

    def reason(self) -> str:
        """One line: why the run stops here."""
        first = self.trips[0] if self.trips else "a gate"
        more = f" (and {len(self.trips) - 1} more)" if len(self.trips) > 1 else ""
        said = f': "{self.comment}"' if self.comment else ""
        return f"data gate rejected by {self.by}{said}; {first}{more}"


class GatesStopped(RuntimeError):
    """A gate tripped and no one can be asked (no Prefect UI): the CLI exits 3 with this line."""

    def __init__(self, decision: GateDecision):
        self.decision = decision
        first, *others = decision.trips
        more = f" (and {len(others)} more)" if others else ""
        super().__init__(f"data gate tripped on {decision.artifact}: {first}{more}; to go on with "
                         f"this data: --approve-gates (or loosen {COLLECT.name}.gates)")


class GatesRejected(RuntimeError):
    """A person rejected the data (or did not answer in time): the run fails with the reason."""

    def __init__(self, decision: GateDecision):
        self.decision = decision
        super().__init__(decision.reason())


def person_can_answer() -> bool:
    """Whether the run talks to a Prefect server with a UI someone can open: a standing server
    (PREFECT_API_URL), not the CLI's embedded one, which lives only as long as the run."""
    return bool(os.environ.get("PREFECT_API_URL")) and not is_embedded_prefect()


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def trips_of(manifest: Manifest, gates: GatesConfig, bytes_per_token: float) -> list[Trip]:
    """The gates the committed collect output `manifest` trips."""
    path = manifest.path / FUNNEL
    funnel = json.loads(path.read_text()) if path.is_file() else {}
    return check(gates, funnel, manifest.stats, bytes_per_token)


def _trips_table(trips: Sequence[Trip]) -> str:
    rows = ["| gate | where | value | limit | numbers |", "|---|---|---:|---:|---|"]
    rows += [f"| `{COLLECT.name}.gates.{t.gate}` | {t.subject} | {t.describe(t.value)} | {t.describe(t.limit)} | "
             f"{t.numbers} |" for t in trips]
    return "\n".join(rows)


def _sample_markdown(row: Mapping) -> str:
    text = " ".join(str(row.get("preview", "")).split())[:PREVIEW_CHARS].replace("~~~", "~ ~ ~")
    where = row.get("url") or row.get("id") or "?"
    return f"**{row.get('reason')}** · `{row.get('source')}` · `{where}`\n\n~~~text\n{text}\n~~~"


def report_markdown(manifest: Manifest, trips: Sequence[Trip]) -> str:
    """The `collect-gates` artifact: the gates with their numbers, the funnel, samples of what was
    removed (review/dropped.jsonl)."""
    path = manifest.path / FUNNEL
    funnel = funnel_markdown(json.loads(path.read_text())) if path.is_file() else "(no funnel.json)"
    shown = samples(trips, _read_jsonl(manifest.path / "review" / "dropped.jsonl"))
    parts = [f"## Data gates tripped on `{COLLECT.name}-{manifest.key}`", "", _trips_table(trips), "",
             f"Artifact: `{manifest.path}`. Approve or reject on this run's page: Resume.", "",
             "### Funnel", "", funnel, "", "### Samples of what was removed", ""]
    parts += [_sample_markdown(row) + "\n" for row in shown] or ["(none kept in review/)"]
    return "\n".join(parts)


def _covering_approval(records: Sequence[Mapping], trips: Sequence[Trip]) -> Mapping | None:
    """The approval that, with the ones before it, first covers every trip; None while some trip was
    never approved."""
    approved: set[str] = set()
    for record in records:
        if record.get("outcome") == "approved":
            approved |= set(record.get("trip_ids", []))
            if {t.id for t in trips} <= approved:
                return record
    return None


def _ask(manifest: Manifest, trips: Sequence[Trip], gates: GatesConfig) -> tuple[bool, str, str]:
    """Pause the flow run until a person answers on its Resume form: (approved, by, comment)."""
    logger = get_run_logger()
    logger.warning("paused for review: %s → Resume, approve on or off, a comment, Submit (waits up to %g s)",
                   flow_run.ui_url, gates.review_timeout_s)
    form = GateReview.with_initial_data(description=(
        f"### Data gates tripped on `{COLLECT.name}-{manifest.key}`\n\n{_trips_table(trips)}\n\n"
        f"The funnel and samples of what was removed: this run's artifact `{ARTIFACT_KEY}`."))
    try:
        answer = pause_flow_run(wait_for_input=form, timeout=int(gates.review_timeout_s), poll_interval=POLL_S)
    except FlowPauseTimeout:
        return False, "nobody", f"no answer within {gates.review_timeout_s:g} s"
    return answer.approve, "a person in the Prefect UI", answer.comment


def enforce(manifest: Manifest, gates: GatesConfig, bytes_per_token: float, store: ArtifactStore,
            tracker: Tracker, run_id: str, approve: bool) -> GateDecision:
    """Check the collect output's gates and decide as the module docstring says; the decision is
    tagged on MLflow run `run_id`. Raises GatesStopped or GatesRejected when the run must not go on."""
    logger = get_run_logger()
    artifact = f"{COLLECT.name}-{manifest.key}"
    trips = trips_of(manifest, gates, bytes_per_token)
    lines = tuple(t.line() for t in trips)
    if not trips:
        decision = GateDecision(outcome="passed", artifact=artifact)
        logger.info("data gates: all passed on %s", artifact)
    elif earlier := _covering_approval(store.gate_decisions(COLLECT.name, manifest.key), trips):
        decision = GateDecision(outcome="approved", artifact=artifact, trips=lines, comment=earlier.get("comment", ""),
                                by=f"an earlier approval ({earlier.get('by')}, {earlier.get('at')})")
        logger.info("data gates: tripped on %s, approved earlier:\n%s", artifact, "\n".join(lines))
    else:
        logger.warning("data gates tripped on %s:\n%s", artifact, "\n".join(lines))
        create_markdown_artifact(report_markdown(manifest, trips), key=ARTIFACT_KEY,
                                 description="Data gates that tripped: numbers, funnel, samples of what was removed")
        if approve:
            ok, by, comment = True, APPROVE_FLAG, ""
        elif person_can_answer():
            ok, by, comment = _ask(manifest, trips, gates)
        else:
            stopped = GateDecision(outcome="stopped", artifact=artifact, trips=lines)
            tracker.set_tags(run_id, stopped.tags())
            raise GatesStopped(stopped)
        decision = GateDecision(outcome="approved" if ok else "rejected", artifact=artifact, trips=lines,
                                by=by, comment=comment)
        store.add_gate_decision(COLLECT.name, manifest.key, {
            **asdict(decision), "trip_ids": [t.id for t in trips], "mlflow_run_id": run_id,
            "prefect_flow_run_id": str(flow_run.id)})
        logger.info("data gates %s by %s%s", decision.outcome, by, f': "{comment}"' if comment else "")
    tracker.set_tags(run_id, decision.tags())
    if decision.outcome == "rejected":
        raise GatesRejected(decision)
    return decision
