"""Every benchmark of `python -m bench` (bench/__main__.py's BENCHMARKS, read here without importing
bench) runs at smoke size (`--smoke`: the smallest sizes that still run each of its code paths),
exits 0 and ends with a JSON line holding the keys docs/benchmarks.md names for it, on its line
"`python -m bench NAME [options]` JSON keys: `key`, ...". A benchmark added to the table is a case
here the day it is added, and fails until the page names its keys. No timing is asserted.

Among the cases, `pretrain --processes 2` with AdamW and with Muon: each rank of a launch once had
a work folder of its own, so rank 1 had nowhere to write its share of the checkpoint rank 0's step
folder holds, and the launch failed. And the fault suite's schedule (`chaos --dry-run`): every kind
of fault drawn before any repeats, and a shorter plan names the kinds it leaves out.

Benchmarks that take a finished run get the session's shared tiny run (TAKE_A_RUN); the chaos
trials use the session's Prefect server. All of them take about 12 minutes on 2 cores, too long for
every CI run: those that take more than about 15 s at smoke size (HEAVY) carry the marker
`bench_smoke`, which the default run deselects; `python -m pytest -m bench_smoke
tests/bench/test_benchmarks.py` runs them (docs/development.md#tests)."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import REPO, STAGES, cli_env

DOCS = REPO / "docs" / "benchmarks.md"
KEYS_LINE = re.compile(r"^`python -m bench ([^`]+)` JSON keys: (.+)$", re.MULTILINE)
# More than about 15 s each at smoke size on 2 cores (most run the pipeline or take a finished run
# of it): opt-in (`-m bench_smoke`). `gpu` runs in CI all the same, in the GPU image's venv
# (tests/bench/test_gpu_check.py).
HEAVY = {"pipeline", "claims", "chaos", "recipe", "scale", "cluster", "startup", "store-fuzz", "memory", "clean",
         "progress", "gpu"}
# Those given the session's shared tiny run (copies of it, as other tests add to its home), which in
# CI other tests have made already: its finished home, its SFT model, its collect and tokenize.
TAKE_A_RUN = {"recipe", "claims", "cluster", "chaos", "startup", "store-fuzz"}


def benchmarks() -> list[str]:
    """The names in bench/__main__.py's BENCHMARKS, in its order."""
    tree = ast.parse((REPO / "bench" / "__main__.py").read_text())
    [table] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and any(isinstance(target, ast.Name) and target.id == "BENCHMARKS" for target in node.targets)]
    return list(ast.literal_eval(table))


def documented() -> dict[str, list[str]]:
    """`NAME [options]` -> the JSON keys docs/benchmarks.md names for that command."""
    return {command: re.findall(r"`([^`]+)`", keys) for command, keys in KEYS_LINE.findall(DOCS.read_text())}


def _cases() -> list:
    """One case per documented command of each benchmark; a benchmark with none is a case that fails."""
    commands = list(documented())
    cases = []
    for name in benchmarks():
        for command in [command for command in commands if command.split()[0] == name] or [name]:
            heavy = name in HEAVY and "--dry-run" not in command.split()
            cases.append(pytest.param(command, marks=[pytest.mark.bench_smoke] if heavy else [],
                                      id=command.replace(" ", "_")))
    return cases


def bench(*args: str, env: dict[str, str] | None = None, timeout: float = 1500) -> subprocess.CompletedProcess:
    """`python -m bench ARGS` from the repository root."""
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def last_json(done: subprocess.CompletedProcess) -> dict:
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output on stdout:\n{done.stderr[-6000:]}"
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"the last line is not JSON: {lines[-1][:500]!r}\n{done.stderr[-3000:]}")


def _given(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """What a benchmark needs besides `--smoke`: its arguments and environment."""
    env = cli_env(tmp_path / "home")  # none of the caller's services; a home of its own
    if name not in TAKE_A_RUN:
        return [], env
    tiny_run = request.getfixturevalue("tiny_run")
    if name == "recipe":  # read only: each run reads the token files
        return [str(tiny_run.committed["tokenize"])], env
    if name == "claims":  # the run's SFT model, in a home of its own
        env["GRISTMILL_HOME"] = str(tiny_run.home_with(tmp_path / "sft-home", tuple(STAGES[:STAGES.index("sft") + 1])))
        return tiny_run.overrides, env
    if name == "cluster":
        return ["--upstream", str(tiny_run.home_with(tmp_path / "upstream", ("collect", "tokenize"))),
                *tiny_run.overrides], env
    home = tiny_run.home_with(tmp_path / "finished")  # a copy: the benchmark's runs add to it
    if name == "chaos":
        prefect = request.getfixturevalue("prefect_server")
        return ["--reference", str(home), "--work", str(tmp_path / "trials"),
                "--prefect-api-url", prefect["PREFECT_API_URL"], *tiny_run.overrides], env
    return ["--home", str(home), *tiny_run.overrides], env  # startup, store-fuzz


def test_every_benchmark_names_its_json_keys_and_every_named_command_is_a_benchmark():
    names, commands = benchmarks(), documented()
    assert names and all(names.count(name) == 1 for name in names)
    assert [name for name in names if not any(c.split()[0] == name for c in commands)] == []
    assert [command for command in commands if command.split()[0] not in names] == []
    assert all(keys for keys in commands.values())


@pytest.mark.parametrize("command", _cases())
def test_the_benchmark_runs_at_smoke_size_and_ends_with_its_documented_json(command, request, tmp_path):
    keys = documented().get(command)
    assert keys, f"docs/benchmarks.md has no line \"`python -m bench {command}` JSON keys: `key`, ...\""
    name, *options = command.split()
    given, env = _given(name, request, tmp_path) if "--dry-run" not in options else ([], cli_env(tmp_path / "home"))
    # the options first: a benchmark's positional arguments (overrides, a folder) come last
    done = bench(name, *options, "--smoke", *given, env=env)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    figures = last_json(done)
    assert [key for key in keys if key not in figures] == [], f"missing from {sorted(figures)}"


def _fault_kinds() -> list[str]:
    """The kinds of fault in the order `python -m bench chaos --help` lists them (its docstring)."""
    described = bench("chaos", "--help").stdout.split("positional arguments:")[0]
    return re.findall(r"^  (\w+) {2,}\S", described, re.MULTILINE)


def test_the_fault_suite_draws_every_kind_before_any_repeats():
    kinds = _fault_kinds()
    assert len(kinds) == 9, kinds
    nine = last_json(bench("chaos", "--trials", "9", "--dry-run"))
    assert sorted(fault for fault, _ in nine["trials"]) == sorted(kinds) and nine["left_out"] == []
    twelve = last_json(bench("chaos", "--trials", "12", "--dry-run"))
    assert [fault for fault, _ in twelve["trials"]] == [*kinds, "kill9", "kill9", "kill9"]
    assert len({stage for fault, stage in twelve["trials"] if fault == "kill9"}) == 4  # kill9 walks the stages


def test_a_shorter_fault_suite_names_the_kinds_it_leaves_out():
    kinds = _fault_kinds()
    done = bench("chaos", "--trials", "3", "--dry-run")
    plan = last_json(done)
    assert [fault for fault, _ in plan["trials"]] == kinds[:3] and plan["left_out"] == kinds[3:]
    assert f"3 trials leave out: {', '.join(kinds[3:])}" in done.stdout.splitlines()
    said = " ".join(bench("chaos", "--help").stdout.split())
    assert "9 or more draw every kind of fault, fewer leave the last kinds of the list above out" in said
