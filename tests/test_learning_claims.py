"""The learning claims of the tiny preset as shipped (full pretraining and SFT), each aligned with
every method, in a home of their own: SFT teaches the answers and keeps the language, GRPO, DPO,
the reward model and PPO each beat the "before" their stage measured on the same held-out data."""
from __future__ import annotations

import json

import pytest
from pipeline_helpers import gristmill

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_preset_methods(tmp_path_factory):
    """Returns method -> the align stage's stats, and the SFT stats."""
    home = tmp_path_factory.mktemp("claims") / "home"
    for method in ("grpo", "dpo", "ppo"):  # the first computes collect to SFT, the others reuse them
        gristmill(home, "run", "configs/tiny.yaml", f"align.method={method}", "--until", "align", timeout=1800)
    [sft] = [json.loads(p.read_text()) for p in (home / "artifacts" / "sft").glob("*/manifest.json")]
    stats = {m["config"]["method"]: m["stats"] for m in
             (json.loads(p.read_text()) for p in (home / "artifacts" / "align").glob("*/manifest.json"))}
    return {**stats, "sft": sft["stats"]}


# Thresholds sit below the smallest gain measured over five seeds of each method on the tiny
# preset's SFT model: `gristmill run configs/tiny.yaml --until sft`, then
# `python -m bench claims --seeds 0,1,2,3,4` (2026-12-01, 2-core machine). Each compares the
# aligned model with a "before" the stage measured on the same held-out data, never a constant.

def test_sft_lowers_heldout_assistant_loss_and_keeps_its_language(tiny_preset_methods):
    """Validation-text loss, measured by the SFT stage on 16 val windows: with pretraining text
    mixed in (sft.pretrain_mix 0.25), 1500 steps continue pretraining as they teach the answers:
    5.680 -> 5.235 nats (perplexity x0.64, sft.seed=0), where arithmetic alone took the evaluate
    stage's perplexity from 335 to 2.6M. Asked: no rise."""
    sft = tiny_preset_methods["sft"]
    assert sft["heldout_loss_after"] < 0.5 * sft["heldout_loss_before"]
    assert sft["val_text_loss_after"] <= sft["val_text_loss_before"]


def test_grpo_raises_heldout_verifiable_accuracy(tiny_preset_methods):
    """186 held-out problems, greedy. Gains over seeds 0-4: accuracy +0.140, +0.140, +0.145,
    +0.113, +0.108 (before 0.102); answer format +0.565, +0.570, +0.570, +0.581, +0.581. Earlier
    whole-pipeline reruns of this preset (each with its own SFT model) gave accuracy gains as low
    as +0.04, hence 0.03; the format gain carries the stronger evidence."""
    grpo = tiny_preset_methods["grpo"]
    assert grpo["heldout_accuracy_after"] >= grpo["heldout_accuracy_before"] + 0.03
    assert grpo["heldout_format_after"] >= grpo["heldout_format_before"] + 0.3


MARGIN_NATS = 1.0  # DPO's held-out log-prob margin gain asked for; the smallest seen is in the docstring


def test_dpo_raises_the_sft_models_heldout_preference(tiny_preset_methods):
    """How strongly the model prefers the chosen reply on 174 held-out pairs: the SFT model's
    measured log-prob margin (nats, chosen minus rejected) and accuracy before, the DPO model's
    after. Margin gains over DPO seeds 0-4: +4.21, +4.82, +4.01, +4.37, +5.95 nats; on the SFT
    model of sft.seed=1, seeds 0-2: +4.27, +4.93, +4.38. The accuracy saturates: whole-pipeline reruns differ in their
    SFT model, and one in CI already preferred the chosen (shorter, committed) reply on 0.874 of the
    pairs (DPO: 0.891), so the accuracy is only required not to fall; locally it rose
    0.40-0.53 -> 0.82-0.90."""
    dpo = tiny_preset_methods["dpo"]
    assert dpo["pairs_heldout"] >= 150
    assert dpo["heldout_logp_margin_after"] >= dpo["heldout_logp_margin_before"] + MARGIN_NATS
    assert dpo["heldout_logp_acc_after"] >= dpo["heldout_logp_acc_before"]


def test_reward_model_beats_random_heads_and_ppo_raises_its_score(tiny_preset_methods):
    """139 held-out pairs. The reward model's accuracy after training against untrained heads:
    the mean over 32 random heads (0.47-0.54; gains +0.24 to +0.27 over seeds 0-4; on the SFT
    model of sft.seed=1: +0.25 to +0.31; a fresh-clone CI run: 0.460 -> 0.748, +0.29). The one
    head this run drew is recorded (`heldout_rm_accuracy_before`) but not asserted on: half the demo
    pairs reject a hedge, which a random head ranks all one way, so a single head's accuracy swings
    with the seed (0.39-0.67 over seeds 0-4, 0.777 in that CI run, above its trained model's 0.748);
    the mean over heads is the baseline with the statistical weight. The reward-model score of greedy
    replies to held-out prompts, PPO policy against the SFT model: +2.55, +2.67, +2.52, +2.44, +2.56
    (sft.seed=1: +2.39, +2.40, +2.26)."""
    ppo = tiny_preset_methods["ppo"]
    assert ppo["rm_pairs_heldout"] >= 130
    assert ppo["heldout_rm_accuracy_after"] >= ppo["heldout_rm_accuracy_untrained_mean"] + 0.12
    assert ppo["heldout_rm_score_after"] >= ppo["heldout_rm_score_before"] + 1.2
