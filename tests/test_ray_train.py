"""Ray Train: two CPU workers run the pretrain stage as one data-parallel job and train the same
curve as a single process."""
from __future__ import annotations

import sys

import pytest
from test_ddp import CONFIG, _assert_same_curve, launch, tokenize_dir  # noqa: F401 (fixture)

from core.stage import read_metrics


@pytest.mark.slow
def test_ray_train_two_workers_match_one_process(tokenize_dir, tmp_path):  # noqa: F811
    from infra import env

    env.configure(tmp_path / "home")
    from infra.ray_train import train_on_ray

    _, one_rows = launch([sys.executable], tokenize_dir, tmp_path / "one")
    workers = train_on_ray(tokenize_dir, tmp_path / "ray", CONFIG, num_workers=2)
    assert [w["rank"] for w in workers] == [0, 1] and {w["world_size"] for w in workers} == {2}
    assert workers[0]["steps"] == workers[1]["steps"] == CONFIG["max_steps"]
    assert workers[0]["val_loss"] == pytest.approx(workers[1]["val_loss"], rel=1e-6)
    _assert_same_curve(one_rows, read_metrics(tmp_path / "ray" / "metrics.jsonl"))
    assert (tmp_path / "ray" / "model" / "model.safetensors").is_file()
