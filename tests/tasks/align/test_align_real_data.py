"""SFT → DPO, GRPO and RM+PPO on real data at small scale: OpenAssistant and self-instruct conversations,
hh-rlhf and AlpacaEval preference pairs, SVAMP word problems (all from shared/data).

A few steps each on a tiny model: the stages must run on these formats, count what they drop,
leave finite metrics, change the weights, resume from their checkpoints and export models that
load and generate."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import gristmill.core.arithmetic as arithmetic
import gristmill.tasks.align.stage as align
import gristmill.tasks.sft.stage as sft
from gristmill.core.stage import Manifest, SerialEngine, read_metrics
from gristmill.tasks.align.rewards import load_math_prompts

OASST = "sft/oasst1_en_validation.jsonl"
SELF_INSTRUCT = "sft/self_instruct_seed_tasks.jsonl"
HH = "prefs/hh_rlhf_harmless_base_test_part1.jsonl.gz"
ALPACA = "prefs/alpaca_eval_gpt4_vs_davinci003_annotations.jsonl"
SVAMP = "rl/svamp.jsonl"

COMMON = dict(max_seq_len=128, seed=0, device="cpu", warmup_frac=0.0)
TRL_ADAMW = dict(weight_decay=0.0, beta2=0.999)  # the TRL trainers' defaults these runs were sized with


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _manifest(stage: str, path: Path) -> Manifest:
    return Manifest(stage=stage, key=f"{stage}-test", path=path, config={}, upstream={}, files={}, stats={})


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def _changed(before: Path, after: Path) -> bool:
    a, b = _weights(before), _weights(after)
    return a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)


def _finite_metrics(out: Path) -> list[dict]:
    logged = read_metrics(out / "metrics.jsonl")
    assert logged and all(math.isfinite(v) for row in logged for v in row.values()), logged
    return logged


def _generates(model_dir: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "How many legs has a cat?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, tiny_model_dir, shared_data) -> Path:
    """SFT on OpenAssistant threads and self-instruct tasks, plus the demo arithmetic that teaches
    the answer sentence the GRPO prompts ask for."""
    root = tmp_path_factory.mktemp("real_sft")
    shutil.copytree(tiny_model_dir, root / "pretrain" / "model")
    config = sft.Config(data=[str(shared_data / OASST), str(shared_data / SELF_INSTRUCT), "demo:arithmetic"],
                        max_examples=200, max_steps=120, batch_size=16, lr=3e-3, checkpoint_every=1000,
                        pretrain_mix=0, **COMMON)  # conversations only: no tokenize artifact here
    stats = sft.run(config, root / "out", engine=SerialEngine(), store_mapping=None,
                    pretrain=_manifest("pretrain", root / "pretrain")).stats
    assert stats["steps"] == 120 and stats["truncated_over_max_seq_len"] > 0  # long threads are cut
    assert stats["heldout_loss_after"] < stats["heldout_loss_before"]
    assert _changed(tiny_model_dir, root / "out" / "model")
    _finite_metrics(root / "out")
    return root / "out"


def test_dpo_on_hh_rlhf_and_alpaca_eval(tmp_path, sft_dir, shared_data):
    config = align.Config(method="dpo", dpo={"data": [str(shared_data / HH), str(shared_data / ALPACA)],
                                             "max_pairs": 24, "heldout_fraction": 0.25, "max_steps": 3,
                                             "batch_size": 4, "lr": 1e-3, "checkpoint_every": 2,
                                             **COMMON, **TRL_ADAMW})
    s = align.run(config, tmp_path, engine=SerialEngine(), store_mapping=None, sft=_manifest("sft", sft_dir)).stats
    assert s["pairs_train"] + s["pairs_heldout"] + s["dropped_prompt_too_long"] == 48
    assert s["truncated_too_long"] > 0  # long multi-turn hh-rlhf prompts and AlpacaEval answers
    assert s["steps"] == 3 and math.isfinite(s["train_loss"]) and math.isfinite(s["heldout_margin_after"])
    assert s["heldout_margin_before"] == 0.0 and s["heldout_margin_after"] != 0.0
    logged = _finite_metrics(tmp_path)
    assert {"rewards/margins", "rewards/accuracies"} <= logged[-1].keys()
    assert _changed(sft_dir / "model", tmp_path / "model")
    _generates(tmp_path / "model")


def test_svamp_prompts_split_by_hash_and_none_dropped(shared_data):
    prompts, drops = load_math_prompts(str(shared_data / SVAMP), None)
    assert len(prompts) == 300 and drops == {}
    heldout = [p for p in prompts if arithmetic.split_of(p["prompt"][-1]["content"]) == "test"]
    assert 30 < len(heldout) < 90  # about TEST_PERCENT of 300


def test_grpo_on_svamp_trains_resumes_and_exports(tmp_path, sft_dir, shared_data, kill_at_metrics_step):
    config = align.Config(method="grpo", grpo={"prompts": [str(shared_data / SVAMP)], "heldout_prompts": 8,
                                               "num_generations": 8, "max_completion_len": 24,
                                               "kl_beta": 0.05, "max_steps": 4, "batch_size": 4, "lr": 1e-3,
                                               "checkpoint_every": 2, **COMMON, **TRL_ADAMW})
    inputs, out = {"sft": _manifest("sft", sft_dir)}, tmp_path / "align.partial"
    kill_at_metrics_step(3)
    with pytest.raises(KeyboardInterrupt):
        align.run(config, out, engine=SerialEngine(), store_mapping=None, **inputs)
    assert (out / "checkpoints" / "checkpoint-2" / "model.safetensors").is_file()
    kill_at_metrics_step(None)

    s = align.run(config, out, engine=SerialEngine(), store_mapping=None, **inputs).stats
    assert s["resumed_from_step"] == 2 and s["steps"] == 4
    prompts, _ = load_math_prompts(str(shared_data / SVAMP), None)
    n_test = sum(arithmetic.split_of(p["prompt"][-1]["content"]) == "test" for p in prompts)
    # word problems too long for max_seq_len with a 16-token completion are dropped and counted
    assert s["dropped_prompt_too_long"] > 0 and s["prompts_heldout"] == 8
    assert 300 - n_test - s["dropped_prompt_too_long"] <= s["prompts_train"] <= 300 - n_test
    for key in ("heldout_accuracy_before", "heldout_accuracy_after", "heldout_format_before",
                "heldout_format_after"):
        assert 0.0 <= s[key] <= 1.0
    logged = _finite_metrics(out)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert {"reward", "kl", "rewards/numeric_match_reward/mean", "rewards/format_reward/mean"} <= logged[0].keys()
    assert _changed(sft_dir / "model", out / "model")
    _generates(out / "model")


def test_ppo_with_a_reward_model_on_hh_rlhf(tmp_path, sft_dir, shared_data):
    ppo = {"data": [str(shared_data / HH)], "max_pairs": 32, "heldout_fraction": 0.25,
           "reward_model": {"lr": 1e-3, "max_steps": 4, "batch_size": 4, "max_seq_len": 256, "device": "cpu",
                            **TRL_ADAMW},
           "policy": {"batch_size": 4, "minibatch_size": 2, "ppo_epochs": 1, "max_new_tokens": 8,
                      "lr": 1e-4, "max_steps": 2, "device": "cpu"}}
    config = align.Config(method="ppo", ppo=ppo)
    s = align.run(config, tmp_path, engine=SerialEngine(), store_mapping=None, sft=_manifest("sft", sft_dir)).stats
    # multi-turn transcripts longer than max_seq_len cannot be scored at their last token: dropped
    assert s["rm_pairs_train"] + s["rm_pairs_heldout"] + s["dropped_rm_too_long"] == 32
    assert s["dropped_rm_too_long"] > 0 and s["rm_steps"] == 4 and s["ppo_steps"] == 2
    assert all(math.isfinite(s[k]) for k in ("rm_train_loss", "ppo_kl_final", "heldout_rm_score_after"))
    logged = _finite_metrics(tmp_path)
    assert any("rm/loss" in row for row in logged) and any("ppo/kl" in row for row in logged)
    assert _changed(sft_dir / "model", tmp_path / "model")
    _generates(tmp_path / "model")
