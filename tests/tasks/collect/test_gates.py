"""Data gates: the check (tasks/collect/output/gates.py) on the tiny preset's numbers and on a collapse, each
gate tripping and not; and the decision in a run (flows/gates.py) with Prefect's edges replaced: an
earlier approval, `approve_gates`, a person's answer (approve, reject, no answer), no one to ask.
The CLI's exit 3 and `--approve-gates`, `gristmill refresh` and the Prefect UI are in
tests/flows/test_gates_cli.py and tests/flows/test_serve_browser.py."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import gristmill.flows.gates as flow_gates
from gristmill.core.stage import Manifest
from gristmill.infra.artifacts import ArtifactStore
from gristmill.tasks.collect.output.gates import GatesConfig, Trip, check, samples, step_of

OFF = GatesConfig(max_removed_fraction=None, max_removed_fraction_per_step=None, max_reason_fraction=None)
SOURCE = "demo:python-docs"
# The tiny preset's collect funnel (configs/tiny.yaml, demo:python-docs), as funnel.json records it.
TINY_STEPS = [("records_read", 729), ("extracted", 695), ("url_filter", 695), ("language", 663),
              ("quality_heuristics", 455), ("exact_dedup", 431), ("near_dedup", 420), ("mix", 420)]
TINY_DROPPED = {"dropped_gopher_below_alpha_threshold": 59, "dropped_duplicated_5_n_grams": 44,
                "dropped_language_score_low": 32, "dropped_gopher_above_avg_threshold": 28,
                "exact_duplicates": 24, "dropped_fineweb_line_punct_ratio": 20, "dropped_gopher_short_doc": 14,
                "near_duplicates": 11, "dropped_dup_line_frac": 11, "dropped_top_4_gram": 9, "dropped_top_3_gram": 7,
                "dropped_fineweb_char_dup_ratio": 4, "dropped_fineweb_short_line_ratio": 3, "dropped_dup_para_frac": 1,
                "dropped_duplicated_7_n_grams": 2, "dropped_duplicated_9_n_grams": 2,
                "dropped_gopher_enough_stop_words": 2, "dropped_gopher_too_many_hashes": 1,
                "dropped_c4_too_few_sentences": 1, "skipped_no_text": 30, "skipped_no_description": 4}
TINY_STATS = {"docs_in": 695, "docs_out": 420, "bytes_out": 2_399_092, "near_dedup_largest_cluster": 3}


def funnel(steps, sources: dict[str, tuple[int, int, dict[str, int]]]) -> dict:
    """A funnel.json: the steps (name, documents after it) and, per source, (documents extracted,
    kept, reason -> records)."""
    total: dict[str, int] = {}
    for _, _, dropped in sources.values():
        for reason, n in dropped.items():
            total[reason] = total.get(reason, 0) + n
    return {"steps": [{"step": name, "docs": docs, "bytes": docs * 1000} for name, docs in steps],
            "per_source": {s: {"docs_in": docs} for s, (docs, _, _) in sources.items()},
            "accounting": {"summary": "in … = kept … + dropped …", "balanced": True, "dropped": total,
                           "per_source": {s: {"kept": kept, "dropped": dropped, "quarantined": {}}
                                          for s, (_, kept, dropped) in sources.items()}}}


TINY = funnel(TINY_STEPS, {SOURCE: (695, 420, TINY_DROPPED)})
# Marin's fuzzy-dedup collapse: one source of 859,092 documents, 2 left.
COLLAPSE = funnel([("records_read", 859_092), ("extracted", 859_092), ("url_filter", 859_092),
                   ("language", 859_092), ("quality_heuristics", 859_092), ("exact_dedup", 859_092),
                   ("near_dedup", 2), ("mix", 2)],
                  {"web": (859_092, 2, {"near_duplicates": 859_090})})
COLLAPSE_STATS = {"docs_in": 859_092, "docs_out": 2, "bytes_out": 8_000, "near_dedup_largest_cluster": 859_091}


def test_the_defaults_never_trip_on_the_tiny_preset_and_catch_a_collapse():
    assert check(GatesConfig(), TINY, TINY_STATS, bytes_per_token=4) == []
    trips = check(GatesConfig(), COLLAPSE, COLLAPSE_STATS, bytes_per_token=4)
    assert [(t.gate, t.subject) for t in trips] == [
        ("max_removed_fraction", "source 'web'"), ("max_reason_fraction", "source 'web', near_duplicates"),
        ("max_removed_fraction_per_step", "step near_dedup")]
    assert trips[0].value == pytest.approx(1 - 2 / 859_092) and trips[0].limit == 0.99
    assert trips[0].line() == ("collect.gates.max_removed_fraction: source 'web': 100.0% > 99.0% "
                               "(859,092 documents → 2 kept)")
    assert all(t.reasons == ("near_duplicates",) for t in trips)


# gate, the value on the tiny funnel, a limit just under it (trips) and the value itself (does not)
GATES = [
    ("max_removed_fraction", (695 - 420) / 695, "source 'demo:python-docs'"),
    ("max_removed_fraction_per_step", (663 - 455) / 663, "step quality_heuristics"),
    ("max_reason_fraction", 59 / 695, "source 'demo:python-docs', dropped_gopher_below_alpha_threshold"),
    ("max_cluster_size", 3, "near-duplicate clusters"),
]


@pytest.mark.parametrize(("gate", "value", "subject"), GATES)
def test_each_maximum_trips_above_its_limit_only(gate, value, subject):
    under = value - 1e-9 if isinstance(value, float) else value - 1
    [trip] = check(OFF.model_copy(update={gate: under}), TINY, TINY_STATS, 4)
    assert (trip.gate, trip.subject, trip.value, trip.limit) == (gate, subject, pytest.approx(value), under)
    assert check(OFF.model_copy(update={gate: value}), TINY, TINY_STATS, 4) == []  # at the limit: passes


@pytest.mark.parametrize(("gate", "kept"), [("min_kept_documents", 420), ("min_kept_tokens", 2_399_092 / 4)])
def test_each_minimum_trips_below_its_limit_only(gate, kept):
    [trip] = check(OFF.model_copy(update={gate: int(kept) + 1}), TINY, TINY_STATS, 4)
    assert (trip.gate, trip.subject, trip.value) == (gate, "the output", pytest.approx(kept))
    assert trip.reasons[:2] == ("dropped_gopher_below_alpha_threshold", "dropped_duplicated_5_n_grams")
    assert check(OFF.model_copy(update={gate: int(kept)}), TINY, TINY_STATS, 4) == []
    assert check(OFF, TINY, TINY_STATS, 4) == []  # None: off


def test_tokens_are_estimated_with_the_given_bytes_per_token():
    gates = OFF.model_copy(update={"min_kept_tokens": 1_000_000})
    assert check(gates, TINY, TINY_STATS, bytes_per_token=2) == []  # 1.2 M tokens
    [trip] = check(gates, TINY, TINY_STATS, bytes_per_token=4)  # 0.6 M
    assert trip.line() == ("collect.gates.min_kept_tokens: the output: 599,773 < 1,000,000 "
                           "(2,399,092 clean bytes / 4 bytes per token)")


def test_only_documents_count_and_every_source_is_checked_on_its_own():
    """Records that never were documents (a WARC's requests: skipped_*) are not removals; a source
    that collapses trips even when the corpus as a whole looks fine."""
    two = funnel(TINY_STEPS, {"warc": (100, 40, {"skipped_non_html": 5000, "dropped_language_score_low": 60}),
                              "big": (10_000, 9_000, {"near_duplicates": 1000}), "empty": (0, 0, {})})
    [trip] = check(OFF.model_copy(update={"max_removed_fraction": 0.5}), two, TINY_STATS, 4)
    assert (trip.subject, trip.value, trip.source) == ("source 'warc'", 0.6, "warc")
    assert trip.reasons == ("dropped_language_score_low",)


def test_a_step_that_adds_documents_and_a_stat_not_recorded_trip_nothing():
    upsampled = funnel([("extracted", 10), ("near_dedup", 10), ("mix", 30)], {"s": (10, 10, {})})
    assert check(OFF.model_copy(update={"max_removed_fraction_per_step": 0.0}), upsampled, {}, 4) == []
    older = {k: v for k, v in TINY_STATS.items() if k != "near_dedup_largest_cluster"}  # before the stat
    assert check(OFF.model_copy(update={"max_cluster_size": 2}), TINY, older, 4) == []


def test_reasons_map_to_their_steps():
    assert [step_of(r) for r in ("dropped_url_blocked_domain", "dropped_language_score_low", "dropped_top_3_gram",
                                 "exact_duplicates", "dropped_low_quality_score", "near_duplicates",
                                 "dropped_benchmark_contamination", "dropped_not_in_mix")] == [
        "url_filter", "language", "quality_heuristics", "exact_dedup", "quality_model", "near_dedup",
        "decontamination", "mix"]


def test_samples_follow_the_trips_reasons_and_source():
    rows = [{"reason": r, "source": s, "preview": f"{r} {s} {i}"} for r in ("a", "b", "c", "d")
            for s in ("x", "y") for i in range(3)]
    trips = [Trip(gate="max_reason_fraction", subject="", value=1, limit=0, numbers="", reasons=("b",), source="y"),
             Trip(gate="max_removed_fraction_per_step", subject="", value=1, limit=0, numbers="",
                  reasons=("d", "a", "c", "b"))]
    assert [r["preview"] for r in samples(trips, rows)] == [
        "b y 0", "b y 1", "d x 0", "d x 1", "a x 0", "a x 1", "c x 0", "c x 1"]


# --- the decision in a run, with Prefect's edges (logger, artifact, pause) and MLflow replaced ---

class Tags:
    def __init__(self):
        self.tags: dict[str, str] = {}

    def set_tags(self, run_id, tags):
        self.tags.update(tags)


@pytest.fixture
def edges(monkeypatch):
    """What the run's Prefect calls did: artifacts made, pauses asked (answered by `answers`)."""
    made = {"artifacts": [], "pauses": [], "answers": []}
    monkeypatch.setattr(flow_gates, "get_run_logger", lambda: logging.getLogger("test-gates"))
    monkeypatch.setattr(flow_gates, "create_markdown_artifact", lambda md, **kw: made["artifacts"].append((md, kw)))

    def pause(wait_for_input, timeout, poll_interval):
        made["pauses"].append((wait_for_input, timeout))
        answer = made["answers"].pop(0)
        if isinstance(answer, Exception):
            raise answer
        return flow_gates.GateReview(**answer)

    monkeypatch.setattr(flow_gates, "pause_flow_run", pause)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return made


def _collect(tmp_path: Path) -> tuple[Manifest, ArtifactStore]:
    store = ArtifactStore(tmp_path / "artifacts")
    path = store.final_dir("collect", "abc123def456")
    (path / "review").mkdir(parents=True)
    (path / "funnel.json").write_text(json.dumps(TINY))
    (path / "review" / "dropped.jsonl").write_text(json.dumps(
        {"reason": "dropped_gopher_below_alpha_threshold", "source": SOURCE, "url": "python-package://x/README",
         "preview": "| 1 | 2 |\n| 3 | 4 |"}) + "\n")
    return Manifest(stage="collect", key="abc123def456", path=path, config={}, upstream={}, files={},
                    stats=TINY_STATS), store


TRIPS_TINY = GatesConfig(max_removed_fraction=0.3, max_reason_fraction=0.07)  # two trips on the tiny numbers


def _enforce(manifest, store, approve=False, gates=TRIPS_TINY):
    tracker = Tags()
    try:
        return flow_gates.enforce(manifest, gates, 4.0, store, tracker, "run-1", approve), tracker.tags
    except (flow_gates.GatesStopped, flow_gates.GatesRejected) as error:
        return error, tracker.tags


def test_without_anyone_to_ask_the_run_stops_with_one_line(tmp_path, edges):
    manifest, store = _collect(tmp_path)
    stopped, tags = _enforce(manifest, store)
    assert isinstance(stopped, flow_gates.GatesStopped)
    assert str(stopped) == ("data gate tripped on collect-abc123def456: collect.gates.max_removed_fraction: source "
                            "'demo:python-docs': 39.6% > 30.0% (695 documents → 420 kept) (and 1 more); to go on "
                            "with this data: --approve-gates (or loosen collect.gates)")
    assert "\n" not in str(stopped)
    assert tags["gristmill.gates.outcome"] == "stopped" and store.gate_decisions("collect", manifest.key) == []
    [(markdown, kw)] = edges["artifacts"]  # what a person would have been shown
    assert kw["key"] == "collect-gates"
    assert "| `collect.gates.max_reason_fraction` | source 'demo:python-docs', dropped_gopher_below_alpha_threshold " \
           "| 8.5% | 7.0% | 59 of 695 documents |" in markdown
    assert "| quality_heuristics | 455 |" in markdown  # the funnel
    assert "~~~text\n| 1 | 2 | | 3 | 4 |\n~~~" in markdown  # a sample, fenced, on one line


def test_approve_gates_goes_on_and_is_remembered_for_that_artifact(tmp_path, edges):
    manifest, store = _collect(tmp_path)
    decision, tags = _enforce(manifest, store, approve=True)
    assert (decision.outcome, decision.by) == ("approved", flow_gates.APPROVE_FLAG)
    assert tags["gristmill.gates.outcome"] == "approved" and len(tags["gristmill.gates.tripped"].split("\n")) == 2
    [record] = store.gate_decisions("collect", manifest.key)
    assert record["trip_ids"] == [
        "max_removed_fraction[source 'demo:python-docs']",
        "max_reason_fraction[source 'demo:python-docs', dropped_gopher_below_alpha_threshold]"]
    # a re-run: not asked again, whatever the limits that make the same gates trip
    again, tags = _enforce(manifest, store, gates=GatesConfig(max_removed_fraction=0.2))
    assert again.outcome == "approved" and again.by.startswith(f"an earlier approval ({flow_gates.APPROVE_FLAG}, ")
    assert len(edges["artifacts"]) == 1 and len(store.gate_decisions("collect", manifest.key)) == 1
    # another gate was never approved: stopped
    other, _ = _enforce(manifest, store, gates=GatesConfig(max_removed_fraction_per_step=0.2))
    assert isinstance(other, flow_gates.GatesStopped) and "step quality_heuristics" in str(other)
    passed, tags = _enforce(manifest, store, gates=GatesConfig())
    assert passed.outcome == "passed" and tags == {"gristmill.gates.outcome": "passed",
                                                   "gristmill.gates.artifact": "collect-abc123def456",
                                                   "gristmill.gates.at": passed.at}


def test_under_a_prefect_server_a_person_approves_or_rejects(tmp_path, edges, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    manifest, store = _collect(tmp_path)
    edges["answers"] += [{"approve": False, "comment": "dedup looks wrong"}, {"approve": True, "comment": "fine"}]
    rejected, tags = _enforce(manifest, store)
    assert isinstance(rejected, flow_gates.GatesRejected)
    assert str(rejected).startswith('data gate rejected by a person in the Prefect UI: "dedup looks wrong"; '
                                    "collect.gates.max_removed_fraction: source 'demo:python-docs': 39.6%")
    assert (tags["gristmill.gates.outcome"], tags["gristmill.gates.comment"]) == ("rejected", "dedup looks wrong")
    [(form, timeout)] = edges["pauses"]
    assert timeout == 86_400 and "| `collect.gates.max_removed_fraction` |" in form._description
    assert "Data gates" in rejected.decision.section().title
    approved, tags = _enforce(manifest, store)  # asked again: a rejection is not remembered as an answer
    assert (approved.outcome, approved.comment, len(edges["pauses"])) == ("approved", "fine", 2)
    assert [r["outcome"] for r in store.gate_decisions("collect", manifest.key)] == ["rejected", "approved"]
    assert flow_gates.GateDecision.from_tags(tags) == approved  # what `gristmill report` rebuilds


def test_no_answer_in_time_is_a_rejection(tmp_path, edges, monkeypatch):
    from prefect.exceptions import FlowPauseTimeout

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    manifest, store = _collect(tmp_path)
    edges["answers"].append(FlowPauseTimeout("Flow run was paused and never resumed."))
    rejected, _ = _enforce(manifest, store, gates=TRIPS_TINY.model_copy(update={"review_timeout_s": 60}))
    assert isinstance(rejected, flow_gates.GatesRejected) and edges["pauses"][0][1] == 60
    assert 'rejected by nobody: "no answer within 60 s"' in str(rejected)


def test_gates_are_not_part_of_the_collect_key():
    from gristmill.flows.config import load_config
    from gristmill.flows.dag import plan

    store = ArtifactStore(Path("/nonexistent"))
    keys = [plan(load_config("configs/tiny.yaml", overrides), store, until="collect")[0].key
            for overrides in ([], ["collect.gates.max_removed_fraction=0.1", "collect.gates.min_kept_documents=5"])]
    assert keys[0] == keys[1]
