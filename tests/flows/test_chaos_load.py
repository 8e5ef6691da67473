"""The load trial's checks (`python -m bench chaos --load N`, bench/harness/load_trial.py) on plain data:
a key computed twice, a run whose record or summary says computed for what another run computed,
and a missing record are each caught; the plan splits the runs between the defaults and the
evaluate-only variants."""
from __future__ import annotations

from bench.harness.load_trial import VARIANTS, overrides_of, summary_statuses, tally

TRUTH = {("collect", "c1"): {"flow_run": "A", "mlflow_run": "a-collect"},
         ("evaluate", "e1"): {"flow_run": "B", "mlflow_run": "b-evaluate"}}


def _record(run: str, stage: str, key: str, reused: bool, source: str | None = None) -> dict:
    return {"flow_run": run, "stage": stage, "key": key, "run_id": f"{run.lower()}-{stage}",
            "reused": reused, "source_run_id": source, "backfilled": False}


def _honest() -> tuple[list[dict], dict]:
    records = [_record("A", "collect", "c1", False), _record("A", "evaluate", "e1", True, "b-evaluate"),
               _record("B", "collect", "c1", True, "a-collect"), _record("B", "evaluate", "e1", False)]
    summaries = {"A": {"collect": "computed", "evaluate": "reused"},
                 "B": {"collect": "reused", "evaluate": "computed"}}
    return records, summaries


def test_truthful_records_and_keys_computed_once_count_as_such():
    records, summaries = _honest()
    result = tally({"A": "COMPLETED", "B": "COMPLETED"}, TRUTH, records, summaries)
    assert {k: result[k] for k in ("runs", "finished", "keys", "computed_once", "records", "truthful_records")} == \
        {"runs": 2, "finished": 2, "keys": 2, "computed_once": 2, "records": 4, "truthful_records": 4}
    assert result["per_run"]["B"] == {"collect": "reused", "evaluate": "computed"}


def test_a_waiting_run_that_says_computed_is_caught_in_mlflow_and_in_its_summary():
    records, summaries = _honest()
    records[2] = _record("B", "collect", "c1", False)  # B waited for A's collect, recorded it as computed
    result = tally({"A": "COMPLETED", "B": "FAILED"}, TRUTH, records, summaries)
    assert (result["finished"], result["computed_once"], result["truthful_records"]) == (1, 1, 3)
    assert result["per_run"]["B"]["collect"] == "?"
    records, summaries = _honest()
    summaries["B"]["collect"] = "computed"  # MLflow right, the Prefect summary wrong
    assert tally({"A": "COMPLETED", "B": "COMPLETED"}, TRUTH, records, summaries)["truthful_records"] == 3


def test_a_reuse_pointing_at_the_wrong_run_or_a_missing_record_is_not_truthful():
    records, summaries = _honest()
    records[1] = _record("A", "evaluate", "e1", True, "someone-else")
    del records[3]  # B's evaluate left no record: its key was computed by no recorded run
    result = tally({"A": "COMPLETED", "B": "COMPLETED"}, TRUTH, records, summaries)
    assert (result["computed_once"], result["records"], result["truthful_records"]) == (1, 3, 2)


def test_half_the_runs_take_the_evaluate_variants_and_the_summary_table_is_read():
    assert overrides_of(8) == [[]] * 4 + [VARIANTS[0], VARIANTS[1]] * 2
    assert all(o.startswith("evaluate.") for variant in VARIANTS for o in variant)
    table = ("| stage | key | status | seconds | artifact |\n|---|---|---|---|---|\n"
             "| collect | c1 | reused | 3.2 | /h/collect-c1 |\n| evaluate | e1 | computed | 9 | /h/e |")
    assert summary_statuses(table) == {"collect": "reused", "evaluate": "computed"}
