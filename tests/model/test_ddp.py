"""Data parallelism on CPU: 2 processes (gloo) train the same curve as 1 process at the same global
batch, launched the two documented ways (`accelerate launch` with the committed config, `torchrun`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import CONFIG, REPO

from gristmill.core.stage import read_metrics


def launch(launcher: list[str], tokenize_dir: Path, out_dir: Path, **overrides) -> tuple[dict, list[dict]]:
    """Run `python -m gristmill.tasks.pretrain` under `launcher`; returns (summary, metric rows)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [*launcher, "-m", "gristmill.tasks.pretrain", str(tokenize_dir), str(out_dir),
           "--config", json.dumps({**CONFIG, **overrides})]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out_dir / "summary.json").read_text()), read_metrics(out_dir / "metrics.jsonl")


def _assert_same_curve(single: list[dict], multi: list[dict]) -> None:
    assert [r["step"] for r in multi] == [r["step"] for r in single] == list(range(1, 7))
    for key in ("loss", "grad_norm", "val_loss"):
        a = [r[key] for r in single if key in r]
        assert a and [r[key] for r in multi if key in r] == pytest.approx(a, rel=1e-4), key


def test_two_processes_train_the_same_curve_as_one(tokenize_dir, tmp_path):
    one, one_rows = launch([sys.executable], tokenize_dir, tmp_path / "one")
    assert one["world_size"] == 1
    accel = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
             str(REPO / "infra" / "accelerate" / "ddp_cpu.yaml")]
    two, two_rows = launch(accel, tokenize_dir, tmp_path / "two")
    assert two["world_size"] == 2  # really two processes (`--cpu --num_processes 2` would give one)
    _assert_same_curve(one_rows, two_rows)
    assert two["tokens_seen"] == one["tokens_seen"] == 6 * 8 * 32
    assert (tmp_path / "two" / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_torchrun_two_processes_train_the_same_curve_with_muon(tokenize_dir, tmp_path):
    """Muon here (AdamW above): each optimizer's data-parallel step equals the single process's."""
    _, one_rows = launch([sys.executable], tokenize_dir, tmp_path / "one", optimizer="muon")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two, two_rows = launch(torchrun, tokenize_dir, tmp_path / "two", optimizer="muon")
    assert two["world_size"] == 2
    _assert_same_curve(one_rows, two_rows)
