"""The align stage's GRPO method: verifiable rewards on the demo arithmetic, held-out accuracy,
KL to the reference, LoRA, resume, and bad prompt files."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from align_helpers import TRL_ADAMW, run_align, sft_inputs, weights

import gristmill.core.arithmetic as arithmetic
import gristmill.tasks.align.stage as align
from gristmill.core.stage import Manifest, SerialEngine, read_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


GRPO = dict(heldout_prompts=8, num_generations=4, max_completion_len=12, temperature=1.0, max_steps=6,
            batch_size=4, lr=5e-3, max_seq_len=64, warmup_frac=0.0, seed=0, device="cpu", checkpoint_every=3,
            **TRL_ADAMW)


def grpo_config(lora: dict | None = None, **grpo) -> align.Config:
    return align.Config(method="grpo", grpo={**GRPO, **grpo}, lora=lora)


@pytest.fixture(scope="module")
def answering_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model after a short SFT on the demo arithmetic: it answers in the demonstrators'
    two styles, committed ("The answer is N.") or hedged, mostly with a wrong number, so
    verifiable rewards vary within a group (a random model scores 0 on all)."""
    import gristmill.tasks.sft.stage as sft

    root = tmp_path_factory.mktemp("sft")
    config = sft.Config(max_steps=80, lr=3e-3, batch_size=16, max_seq_len=64, device="cpu",
                        checkpoint_every=1000, pretrain_mix=0)  # conversations only: no tokenize artifact
    sft.run(config, root / "out", engine=SerialEngine(), store_mapping=None, **_pretrain_inputs(root, tiny_model_dir))
    return root / "out" / "model"


def _pretrain_inputs(root: Path, model_dir: Path) -> dict[str, Manifest]:
    shutil.copytree(model_dir, root / "pretrain" / "model")
    return {"pretrain": Manifest(stage="pretrain", key="pretrain-test", path=root / "pretrain", config={},
                                 upstream={}, files={}, stats={})}


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, answering_model_dir):
    """One uninterrupted GRPO run on demo:arithmetic: (inputs, out_dir, stats)."""
    root = tmp_path_factory.mktemp("grpo")
    inputs = sft_inputs(root, answering_model_dir)
    result = run_align(grpo_config(), inputs, root / "align.partial")
    return inputs, root / "align.partial", result.stats


def test_grpo_stage_trains_measures_and_exports(grpo_run):
    from transformers import AutoModelForCausalLM

    inputs, out, s = grpo_run
    assert s["method"] == "grpo" and s["steps"] == 6 and s["resumed_from_step"] == 0
    assert s["prompts_heldout"] == 8 and s["dropped_prompt_too_long"] == 0
    assert s["prompts_train"] == sum(arithmetic.split_of(p.question) == "train" for p in arithmetic.universe())
    # the short SFT taught the reply styles, hardly the arithmetic
    assert s["heldout_accuracy_before"] <= 0.5
    for key in ("heldout_format_before", "heldout_accuracy_after", "heldout_format_after"):
        assert 0.0 <= s[key] <= 1.0
    assert 0.0 <= s["train_reward_start"] <= 1.1 and 0.0 <= s["train_reward_end"] <= 1.1
    assert math.isfinite(s["train_loss"]) and math.isfinite(s["train_reward_end"])
    before, after = weights(inputs["sft"].path / "model"), weights(out / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (out / "checkpoints").exists()
    logged = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(1, 7))
    assert {"loss", "reward", "reward_std", "rewards/numeric_match_reward/mean",
            "rewards/format_reward/mean", "entropy"} <= logged[-1].keys()
    assert all(math.isfinite(v) for r in logged for v in r.values())
    AutoModelForCausalLM.from_pretrained(out / "model")


def test_grpo_kl_to_reference_is_logged(tmp_path, answering_model_dir):
    config = grpo_config(kl_beta=0.1, max_steps=3)
    run_align(config, sft_inputs(tmp_path, answering_model_dir), tmp_path / "out")
    logged = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert logged[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference
    assert all(r["kl"] >= 0 and math.isfinite(r["kl"]) for r in logged) and logged[-1]["kl"] > 0


def test_grpo_with_lora_uses_the_adapter_free_model_as_reference(tmp_path, answering_model_dir):
    config = grpo_config(kl_beta=0.1, max_steps=3, lora={"rank": 4})
    s = run_align(config, sft_inputs(tmp_path, answering_model_dir), tmp_path / "out").stats
    assert 0 < s["params_trainable"] < s["params_total"] / 2
    logged = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert logged[0]["kl"] == pytest.approx(0.0, abs=1e-6) and all(math.isfinite(r["kl"]) for r in logged)
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    assert set(weights(tmp_path / "out" / "model")) == set(weights(answering_model_dir))


def test_grpo_drops_the_hedging_habit_and_raises_the_reward(tmp_path, answering_model_dir):
    """The demo's learnable rule: hedged replies never verify, committed ones carry the format
    reward and sometimes the right number; GRPO must shift the model to committing."""
    config = grpo_config(num_generations=8, format_weight=1.0, max_steps=30, lr=2e-3, checkpoint_every=100)
    s = run_align(config, sft_inputs(tmp_path, answering_model_dir), tmp_path / "out").stats
    logged = read_metrics(tmp_path / "out" / "metrics.jsonl")
    formats = [r["rewards/format_reward/mean"] for r in logged]
    assert sum(formats[-5:]) / 5 > sum(formats[:5]) / 5 + 0.2, formats
    assert s["train_reward_end"] > s["train_reward_start"]
    assert s["heldout_format_after"] > s["heldout_format_before"]


def test_killed_grpo_run_resumes_from_checkpoint(tmp_path, answering_model_dir, grpo_run, kill_at_metrics_step):
    inputs, out = sft_inputs(tmp_path, answering_model_dir), tmp_path / "align.partial"
    config = grpo_config()
    kill_at_metrics_step(5)
    with pytest.raises(KeyboardInterrupt):
        run_align(config, inputs, out)
    assert (out / "checkpoints" / "checkpoint-3").is_dir()
    kill_at_metrics_step(None)

    stats = run_align(config, inputs, out).stats
    assert stats["resumed_from_step"] == 3 and stats["steps"] == 6
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 7))
    # sampling RNG, weights, optimizer and data order are restored: same model as never stopping
    resumed, uninterrupted = weights(out / "model"), weights(grpo_run[1] / "model")
    assert all(torch.allclose(resumed[k], uninterrupted[k], atol=1e-5) for k in uninterrupted)
    assert stats["heldout_accuracy_before"] == grpo_run[2]["heldout_accuracy_before"]


def test_grpo_without_usable_prompts_names_the_file(tmp_path, tiny_model_dir):
    path = tmp_path / "no_answers.jsonl"
    path.write_text(json.dumps({"question": "How many?", "answer": "lots"}) + "\n")
    config = grpo_config(prompts=[str(path)])
    with pytest.raises(ValueError, match=r"no_answers\.jsonl.*no_numeric_answer"):
        run_align(config, sft_inputs(tmp_path, tiny_model_dir), tmp_path / "out")


