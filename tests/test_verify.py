"""A store that proves its bytes: one byte flipped in each stage's committed output, found by
`gristmill verify`, refused for reuse under `store.verify_on_reuse=sha256`, set aside by
`--repair` with what was computed from it, and recomputed to the same bytes by the next run."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import REPO, STAGES, cli_env, gristmill, plan_of

from bench.runs import TIMED_FILES
from infra.artifacts import SMALL_FILE_BYTES


@pytest.mark.slow
def test_verify_finds_a_flipped_byte_in_every_stage_and_repair_lets_the_next_run_recompute(tiny_run, prefect_server,
                                                                                           tmp_path):
    home = tmp_path / "home"
    shared = _outputs(tiny_run.proc.stdout)  # this run's own outputs (other tests add more to its home)
    flipped = {}
    for stage, source in shared.items():
        directory = home / "artifacts" / stage / source.name
        shutil.copytree(source, directory)
        largest = max((p for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json"),
                      key=lambda p: p.stat().st_size)
        data = bytearray(largest.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the content tells
        largest.write_bytes(bytes(data))
        flipped[stage] = largest

    def verify(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", "verify", *flags], cwd=REPO, env=cli_env(home),
                              capture_output=True, text=True, timeout=300)

    found = verify()
    assert found.returncode == 1, found.stdout + found.stderr
    for stage, path in flipped.items():
        rel = path.relative_to(next(p for p in path.parents if p.parent.name == stage)).as_posix()
        assert any(line.startswith(f"DAMAGED {stage}-") and f"{rel} (sha256 differs)" in line
                   for line in found.stdout.splitlines()), (stage, found.stdout)
    assert f"verified {len(STAGES)} artifact(s)" in found.stdout

    # Reuse: size checks pass the big files; sha256 refuses every stage.
    by_size = plan_of(home, tiny_run.overrides)
    assert by_size == {stage: "run" if path.stat().st_size <= SMALL_FILE_BYTES else "reuse"
                       for stage, path in flipped.items()}
    assert plan_of(home, tiny_run.overrides, "store.verify_on_reuse=sha256") == {s: "run" for s in STAGES}

    repaired = verify("--repair")
    aside = [line for line in repaired.stdout.splitlines() if line.startswith("  set aside ")]
    assert repaired.returncode == 0 and len(aside) == len(STAGES), repaired.stdout
    assert len(list((home / "artifacts" / "collect").glob("collect-*.corrupt-*"))) == 1
    assert "verified 0 artifact(s)" in verify().stdout

    gristmill(home, "run", "configs/tiny.yaml", *tiny_run.overrides, "--until", "tokenize", services=prefect_server)
    for stage in ("collect", "tokenize"):  # recomputed, under the same key, to the same bytes
        assert _digests(home / "artifacts" / stage / shared[stage].name) == _digests(shared[stage])


def _outputs(run_stdout: str) -> dict[str, Path]:
    """stage -> committed directory, from the `STAGE  PATH` lines a run ends with."""
    rows = [line.split() for line in run_stdout.splitlines()]
    return {row[0]: Path(row[1]) for row in rows if len(row) == 2 and row[0] in STAGES and "/artifacts/" in row[1]}


def _digests(directory: Path) -> dict[str, str]:
    files = json.loads((directory / "manifest.json").read_text())["files"]
    return {rel: info["sha256"] for rel, info in files.items() if Path(rel).name not in TIMED_FILES}
