"""A store that proves its bytes: one byte flipped in each stage's committed output, found by
`gristmill verify`, refused for reuse under `store.verify_on_reuse=sha256`, set aside by
`--repair` with what was computed from it, and recomputed to the same bytes by the next run.
And `verify` as a command: every entry named, each finding with its repair, exit codes, and no
store created where there is none."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import REPO, STAGES, cli_env, gristmill, plan_of

from bench.harness.runs import TIMED_FILES
from gristmill.flows.stages import contracts
from gristmill.infra.artifacts import SMALL_FILE_BYTES, ArtifactStore

KEY = "0123456789ab"
TOKENIZE_FILES = ("tokenizer/tokenizer.json", "tokens/train.bin", "tokens/val.bin", "tokens/meta.json",
                  "tokens/index.json")


def _cli(home: Path | None, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m gristmill ARGS` with GRISTMILL_HOME `home` (unset when None)."""
    env = cli_env(home or Path("unused"))
    if home is None:
        env.pop("GRISTMILL_HOME")
    return subprocess.run([sys.executable, "-m", "gristmill", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _tokenize_output(home: Path) -> Path:
    """A tokenize output that meets the stage's contract, committed by the store."""
    def compute(partial: Path) -> dict:
        for rel in TOKENIZE_FILES:
            (partial / rel).parent.mkdir(parents=True, exist_ok=True)
            (partial / rel).write_text(rel)
        return {"config": {}, "upstream": {}, "stats": {}, "meta": {}}
    store = ArtifactStore(home / "artifacts", contracts=contracts())
    return store.materialize("tokenize", KEY, compute)[0].path


def test_a_typo_in_the_stage_is_exit_2_naming_the_stages(tmp_path):
    _tokenize_output(tmp_path)
    done = _cli(tmp_path, "verify", "--stage", "prtrain")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("gristmill: --stage 'prtrain' is not a stage; choose one of "
                           "collect, tokenize, pretrain, sft, align, evaluate\n")


def test_verify_and_a_dry_run_from_the_wrong_directory_create_no_store(tmp_path):
    done = _cli(None, "verify", cwd=tmp_path)
    assert done.returncode == 2 and "no artifact store at" in done.stderr
    planned = _cli(None, "run", str(REPO / "configs" / "tiny.yaml"), "--dry-run", cwd=tmp_path)
    assert planned.returncode == 0 and "collect" in planned.stdout.split("# plan", 1)[1], planned.stderr
    assert os.listdir(tmp_path) == []


def test_every_entry_is_named_each_finding_exits_1_with_its_repair_and_repair_clears_them(tmp_path):
    output = _tokenize_output(tmp_path)
    (output / "tokens" / "train.bin").unlink()
    (output.parent / f"tokenize-{KEY}.partial").mkdir()
    (tmp_path / "artifacts" / "prtrain").mkdir()
    found = _cli(tmp_path, "verify")
    assert found.returncode == 1, found.stderr
    lines = found.stdout.splitlines()
    assert f"DAMAGED tokenize-{KEY}: tokens/train.bin (missing) [repair: gristmill verify --repair]" in lines
    assert "UNKNOWN prtrain: not written by gristmill [repair: gristmill verify --repair sets it aside]" in lines
    assert f"partial   tokenize/tokenize-{KEY}.partial: work in progress: the next run of this key resumes it" \
        in lines
    assert lines[-2].startswith("verified 1 artifact(s) under ") and "1 damaged, 1 unknown; 1 partial" in lines[-2]
    assert lines[-1].startswith("2 finding(s); `gristmill verify --repair` sets each damaged output")

    repaired = _cli(tmp_path, "verify", "--repair")
    assert repaired.returncode == 0 and repaired.stdout.count("  set aside ") == 2, repaired.stdout
    again = _cli(tmp_path, "verify")
    assert again.returncode == 0, again.stdout
    assert again.stdout.count("set aside ") == 2 and "verified 0 artifact(s)" in again.stdout


def test_repair_on_a_read_only_store_is_one_line_and_moves_nothing(tmp_path):
    """The store a read-only bind mount, in a mount namespace of this command's own (root writes
    through a read-only mode, not through a read-only mount)."""
    output = _tokenize_output(tmp_path)
    (output / "tokens" / "train.bin").unlink()
    (tmp_path / "artifacts" / "prtrain").mkdir()
    store = tmp_path / "artifacts"
    before = sorted(store.rglob("*"))
    read_only = f"mount --bind {store} {store} && mount -o remount,bind,ro {store} && exec \"$@\""
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", read_only, "sh",
                           sys.executable, "-m", "gristmill", "verify", "--repair"], cwd=REPO,
                          env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"gristmill: --repair writes in the artifact store, and {store} cannot be written "
                           "(Read-only file system): nothing was set aside or sealed\n")
    assert f"DAMAGED tokenize-{KEY}: tokens/train.bin (missing)" in done.stdout  # the findings, still named
    assert sorted(store.rglob("*")) == before


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
        return subprocess.run([sys.executable, "-m", "gristmill", "verify", *flags], cwd=REPO, env=cli_env(home),
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
