"""The load trial's plan and checks on plain data (`python -m bench chaos --load N`, whose
bench/chaos_load.py gathers the data from a standing stack): which overrides each of N runs gets,
and whether, after they raced for the same keys, each key was computed once and every run's MLflow
record and pipeline summary tell the truth the artifact store's manifests hold."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from bench.harness.runs import STAGES

# Each changes only the evaluate stage's key: the load costs one shared pipeline plus two evaluations.
VARIANTS = (["evaluate.arith_problems=10"], ["evaluate.arith_problems=30"])


def overrides_of(runs: int) -> list[list[str]]:
    """Each run's overrides: the first half none (the deployment's defaults), the rest alternating
    between the VARIANTS."""
    plain = runs - runs // 2
    return [[] for _ in range(plain)] + [VARIANTS[i % len(VARIANTS)] for i in range(runs - plain)]


def tally(states: Mapping[str, str], manifests: Mapping[tuple[str, str], Mapping[str, str]],
          records: Iterable[Mapping[str, Any]], summaries: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """The checks, from plain data. `states`: flow run -> Prefect state type; `manifests`: (stage,
    key) -> {"flow_run", "mlflow_run"} that computed it; `records`: MLflow stage runs as {"flow_run"
    (of their parent), "stage", "key", "run_id", "reused" (bool), "source_run_id", "backfilled"}
    ; `summaries`: flow run -> stage -> status in its pipeline-summary. Adds `per_run`: flow run ->
    stage -> "computed" | "reused" | "?" (what its record says; "?" when it is not one record that
    tells the truth)."""
    records = list(records)
    computing = defaultdict(list)
    by_run_stage = defaultdict(list)
    for record in records:
        by_run_stage[record["flow_run"], record["stage"]].append(record)
        if not record["reused"]:
            computing[record["stage"], record["key"]].append(record)
    once = sum(1 for key, truth in manifests.items()
               if [(r["run_id"], r["flow_run"]) for r in computing[key]] == [(truth["mlflow_run"], truth["flow_run"])])
    per_run: dict[str, dict[str, str]] = {run: {} for run in states}
    truthful = 0
    for (run, stage), found in by_run_stage.items():
        record = found[0]
        truth = manifests.get((stage, record["key"]))
        said = "reused" if record["reused"] else "computed"
        honest = (len(found) == 1 and truth is not None
                  and record["reused"] == (truth["flow_run"] != run)
                  and (not record["reused"] or record["source_run_id"] == truth["mlflow_run"])
                  and summaries.get(run, {}).get(stage) == said)
        truthful += honest
        per_run.setdefault(run, {})[stage] = said if honest else "?"
    return {"runs": len(states), "finished": sum(s == "COMPLETED" for s in states.values()),
            "keys": len(manifests), "computed_once": once, "records": len(by_run_stage),
            "truthful_records": truthful, "backfilled": sum(bool(r["backfilled"]) for r in records),
            "per_run": per_run}


def summary_statuses(markdown: str) -> dict[str, str]:
    """stage -> status from a pipeline-summary table (`| stage | key | status | seconds | artifact |`)."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in markdown.splitlines() if line.startswith("| ")]
    return {row[0]: row[2] for row in rows[1:] if len(row) >= 3 and row[0] in STAGES}
