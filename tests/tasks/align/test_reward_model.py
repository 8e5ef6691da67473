"""Reward model: Bradley–Terry training on preference pairs, held-out accuracy, resume, scoring."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import gristmill.tasks.align.reward_model as rm
from gristmill.core.stage import MetricsLog, read_metrics
from gristmill.tasks.align.config import RewardModelConfig
from gristmill.tasks.align.preferences import load_preference_pairs

RM_CONFIG = {"lr": 3e-3, "max_steps": 12, "batch_size": 8, "max_seq_len": 64, "warmup_frac": 0.1,
             "seed": 0, "device": "cpu", "checkpoint_every": 6, "weight_decay": 0.0, "beta2": 0.999}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def courtesy_pairs(n: int) -> list[dict]:
    """Pairs whose preference generalises to unseen prompts, so a random tiny trunk can learn it:
    a courteous reply over a curt one, on arithmetic prompts."""
    pairs, _ = load_preference_pairs("demo:arithmetic", n)
    return [{"prompt": p["prompt"], "chosen": "Gladly, here it is.", "rejected": "No. Go away."} for p in pairs]


def _train(tiny_model_dir: Path, out: Path, **overrides):
    pairs = courtesy_pairs(48)
    out.mkdir(exist_ok=True)
    config = RewardModelConfig(**{**RM_CONFIG, **overrides})
    return rm.train_reward_model(tiny_model_dir, pairs[:36], pairs[36:], config, out, MetricsLog(out))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """One uninterrupted run: (out_dir, rm_dir, stats)."""
    out = tmp_path_factory.mktemp("rm")
    rm_dir, stats = _train(tiny_model_dir, out)
    return out, rm_dir, stats


def test_settings_validate_and_describe_every_field():
    with pytest.raises(ValidationError, match="lr"):
        RewardModelConfig(lr=0)
    with pytest.raises(ValidationError, match="max_seq_len"):
        RewardModelConfig(max_seq_len=2)
    assert all(f.description for f in RewardModelConfig.model_fields.values())
    assert "checkpoint_every" not in RewardModelConfig().hashed_dict()


def test_pair_stats_counts_ties_as_wrong():
    s = rm.pair_stats(torch.tensor([1.0, 0.5, 2.0, 0.0]), torch.tensor([0.0, 0.5, 3.0, -1.0]))
    assert s["accuracy"] == 0.5 and s["margin"] == pytest.approx((1 + 0 - 1 + 1) / 4)


def test_reward_model_learns_a_generalising_preference(trained):
    out, rm_dir, s = trained
    assert s["rm_pairs_train"] == 36 and s["rm_pairs_heldout"] == 12 and s["dropped_rm_too_long"] == 0
    assert s["rm_steps"] == 12 and s["rm_resumed_from_step"] == 0
    # All held-out pairs share one (chosen, rejected) text pair, so before training the random head
    # orders them nearly all the same way: the accuracy is 0 or 1 by chance, the margin tiny.
    assert abs(s["heldout_rm_margin_before"]) < 0.5
    assert s["heldout_rm_accuracy_after"] == 1.0 and s["heldout_rm_margin_after"] > 1.0
    assert not (out / rm.RM_CHECKPOINT_DIR).exists()
    logged = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(1, 13))
    assert logged[0]["rm/loss"] == pytest.approx(0.6931, abs=0.05)  # log 2: scores start near equal
    assert logged[-1]["rm/loss"] < 0.3
    assert json.loads((rm_dir / rm.STATS_FILE).read_text()) == s


def test_scorer_matches_training_scores_and_ignores_batch_padding(trained):
    _, rm_dir, _ = trained
    scorer = rm.RewardScorer(rm_dir, batch_size=4)
    prompts = [p["prompt"] for p in courtesy_pairs(6)]
    # responses of different lengths, so batched rows are padded
    responses = ["Gladly, here it is.", "No. Go away.", "Gladly!", "No.", "The answer is 4.", "Go."]
    batched = scorer.score(prompts, responses)
    one_by_one = torch.cat([scorer(prompts[i:i + 1], responses[i:i + 1]) for i in range(6)])
    assert batched.shape == (6,) and batched.dtype == torch.float32
    assert torch.allclose(batched, one_by_one, atol=1e-5)
    assert batched[0] > batched[1]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        scorer.score(prompts[:2], responses[:1])


def test_finished_reward_model_is_reused(trained, tiny_model_dir):
    out, rm_dir, stats = trained
    weights = (rm_dir / "model.safetensors").stat().st_mtime_ns
    again_dir, again = _train(tiny_model_dir, out)
    assert again_dir == rm_dir and again == stats
    assert (rm_dir / "model.safetensors").stat().st_mtime_ns == weights


def test_killed_training_resumes_to_the_same_model(tmp_path, tiny_model_dir, trained, kill_at_metrics_step):
    from safetensors.torch import load_file

    kill_at_metrics_step(9)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny_model_dir, tmp_path)
    assert (tmp_path / rm.RM_CHECKPOINT_DIR / "checkpoint-6").is_dir()
    kill_at_metrics_step(None)

    rm_dir, stats = _train(tiny_model_dir, tmp_path)
    assert stats["rm_resumed_from_step"] == 6 and stats["rm_steps"] == 12
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 13))
    resumed, uninterrupted = load_file(rm_dir / "model.safetensors"), load_file(trained[1] / "model.safetensors")
    assert all(torch.allclose(resumed[k], uninterrupted[k], atol=1e-5) for k in uninterrupted)
    assert stats["heldout_rm_accuracy_after"] == trained[2]["heldout_rm_accuracy_after"]


def test_too_short_max_seq_len_names_the_setting(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="max_seq_len=8"):
        _train(tiny_model_dir, tmp_path, max_seq_len=8)
