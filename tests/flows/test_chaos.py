"""The fault suite's short version (`python -m bench chaos`), against the shared tiny run: a
kill -9 mid-collect, Ctrl-C mid-SFT and two identical runs at once in a fresh home, each survived
with nothing lost and the output identical to the uninterrupted run's. The kill -9 and Ctrl-C runs
use the session's standing Prefect server (tests/infra/test_interrupts.py stops runs with their own);
the two runs at once each start their own, racing to create its database."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pipeline_helpers import REPO, cli_env

pytestmark = pytest.mark.slow


def test_the_short_fault_suite_survives_every_trial(tiny_run, prefect_server, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "chaos", "--trials", "3", "--seed", "0",
                           "--reference", str(tiny_run.home_with(tmp_path / "shared-run")), "--work", str(tmp_path),
                           "--prefect-api-url", prefect_server["PREFECT_API_URL"],
                           *tiny_run.overrides], cwd=REPO, env=cli_env(tmp_path / "unused"),
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("trial")]
    assert [row.split()[2] for row in rows] == ["kill9", "sigint", "concurrent"], proc.stdout
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    left_out = ["fuzz", "ray_worker", "commit", "disk_full", "mlflow_down", "prefect_restart"]  # 3 trials draw 3 kinds
    assert summary == {"trials": 3, "survived": 3, "identical": 3, "docs_lost": 0, "left_out": left_out}, proc.stdout
