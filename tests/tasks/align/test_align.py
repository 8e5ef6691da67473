"""Preference-data loading (format detection, drop counts) and the align stage end to end: DPO and
GRPO with verifiable rewards (training, held-out measurements, LoRA, resume), and the alignment
section of the evaluation report."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Literal, get_args

import pytest
import torch
from align_helpers import TRL_ADAMW, run_align, sft_inputs, weights
from pydantic import Field, ValidationError

import gristmill.tasks.align.stage as align
from gristmill.core.stage import StageConfig, read_metrics
from gristmill.model.ranks import Ranks
from gristmill.tasks.align.config import DPOConfig, GRPOConfig, fingerprint
from gristmill.tasks.align.method import AlignJob
from gristmill.tasks.align.preferences import (
    detect_format,
    load_preference_pairs,
    split_transcript,
)

HH = "prefs/hh_rlhf_harmless_base_test_part1.jsonl.gz"
ALPACA = "prefs/alpaca_eval_gpt4_vs_davinci003_annotations.jsonl"


# ---------------------------------------------------------------- preference data

def test_hh_rlhf_splits_shared_prefix_from_final_replies(shared_data):
    pairs, drops = load_preference_pairs(str(shared_data / HH), None)
    # 1156 records; 4 end with an empty assistant reply (counted by hand on the file)
    assert len(pairs) == 1152 and drops == {"empty_response": 4}
    first = pairs[0]
    assert first["prompt"][0] == {"role": "user", "content": "what are some pranks with a pen i can do?"}
    assert first["prompt"][-1]["role"] == "user"
    assert [m["role"] for m in first["prompt"][:4]] == ["user", "assistant", "user", "assistant"]
    assert first["chosen"] != first["rejected"]
    assert first["rejected"].startswith("There are lots of funny things you can do with pens")
    assert all(p["prompt"][-1]["role"] == "user" and p["chosen"] != p["rejected"] for p in pairs)
    assert not any("\n\nHuman:" in p["chosen"] or "\n\nAssistant:" in p["chosen"] for p in pairs)


def test_alpaca_eval_orients_by_preference_and_drops_ties(shared_data):
    path = shared_data / ALPACA
    pairs, drops = load_preference_pairs(str(path), None)
    assert drops == {"tie": 12} and len(pairs) == 805 - 12
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kept = [r for r in records if r["preference"] != 0]
    for record, pair in zip(kept[:50], pairs[:50]):
        winner, loser = ("output_1", "output_2") if record["preference"] == 1 else ("output_2", "output_1")
        assert pair == {"prompt": [{"role": "user", "content": record["instruction"]}],
                        "chosen": record[winner], "rejected": record[loser]}
    assert detect_format(records[0], "x") == "alpaca_eval"


def test_limit_stops_early(shared_data):
    pairs, _ = load_preference_pairs(str(shared_data / HH), 5)
    assert len(pairs) == 5


def test_prompt_chosen_rejected_rows_and_bad_rows(tmp_path):
    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "chosen": [{"role": "assistant", "content": "Hello."}], "rejected": "Go away."},
        {"prompt": "same?", "chosen": "yes", "rejected": "yes"},
        {"prompt": "empty?", "chosen": "  ", "rejected": "no"},
        {"prompt": "list?", "chosen": ["not", "messages"], "rejected": "no"},
    ]
    path = tmp_path / "prefs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    pairs, drops = load_preference_pairs(str(path), None)
    assert drops == {"same_response": 1, "empty_response": 1, "unparseable_record": 1}
    assert pairs[0] == {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"}
    assert pairs[1]["prompt"][0]["role"] == "system" and pairs[1]["chosen"] == "Hello."


def test_hh_transcript_edge_cases(tmp_path):
    assert split_transcript("no markers here") is None
    assert split_transcript("\n\nHuman: hi\n\nAssistant: hello") == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [{"chosen": "garbage", "rejected": "\n\nHuman: a\n\nAssistant: b"},
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: x\n\nAssistant: c"},
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: b"}]
    path = tmp_path / "hh.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"hh\.jsonl.*no usable pairs"):
        load_preference_pairs(str(path), None)


def test_unknown_format_and_source_name_the_source(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"odd\.jsonl.*unknown preference format"):
        load_preference_pairs(str(path), None)
    with pytest.raises(ValueError, match="demo:nope"):
        load_preference_pairs("demo:nope", None)


def test_demo_arithmetic_is_seeded():
    a, drops = load_preference_pairs("demo:arithmetic", 20, seed=3)
    b, _ = load_preference_pairs("demo:arithmetic", 20, seed=3)
    c, _ = load_preference_pairs("demo:arithmetic", 20, seed=4)
    assert a == b and a != c and drops == {} and len(a) == 20
    assert all(p["chosen"] != p["rejected"] for p in a)


# ---------------------------------------------------------------- config

def test_fingerprint_follows_file_contents(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    config = align.Config(dpo={"data": ["demo:arithmetic", str(path)]})
    first = fingerprint(config)
    assert fingerprint(config) == first
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "d"}) + "\n")
    assert fingerprint(config) != first
    # GRPO reads its prompt files, not the preference files
    grpo = align.Config(method="grpo", dpo={"data": [str(path)]}, grpo={"prompts": [str(path)]})
    before = fingerprint(grpo)
    path.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n")
    assert fingerprint(grpo) != before


def test_config_validation_names_the_field():
    with pytest.raises(ValidationError, match=r"dpo\.beta"):
        align.Config(dpo={"beta": 0})
    with pytest.raises(ValidationError, match=r"dpo\.data"):
        align.Config(dpo={"data": []})
    with pytest.raises(ValidationError, match=r"grpo\.num_generations"):
        align.Config(grpo={"num_generations": 1})
    with pytest.raises(ValidationError, match=r"grpo\.unknown"):
        align.Config(grpo={"unknown": 1})
    with pytest.raises(ValidationError, match="method"):
        align.Config(method="rlhf")
    assert "checkpoint_every" not in align.Config().hashed_dict()
    for model in (align.Config, DPOConfig, GRPOConfig):
        assert all(f.description for f in model.model_fields.values())


def test_only_the_chosen_methods_section_is_hashed():
    dpo, grpo = align.Config(), align.Config(method="grpo")
    assert "dpo" in dpo.hashed_dict() and "grpo" not in dpo.hashed_dict()
    assert "grpo" in grpo.hashed_dict() and "dpo" not in grpo.hashed_dict()
    assert align.Config(grpo={"kl_beta": 0.5}).hashed_dict() == dpo.hashed_dict()
    assert align.Config(method="grpo", grpo={"kl_beta": 0.5}).hashed_dict() != grpo.hashed_dict()


def test_the_registry_and_the_config_name_the_same_methods():
    """A method registered without its section (or a section without its registry entry or its
    name among `method`'s choices) fails here, not when someone picks it."""
    choices = set(get_args(align.Config.model_fields["method"].annotation))
    sections = set(align.Config.model_fields) - {"method", "lora", "launch"}
    assert set(align.METHODS) == choices == sections and {"dpo", "grpo", "ppo"} <= sections
    for name in sections:
        section = align.Config.model_fields[name].default_factory()
        assert isinstance(section.sources(), list), name


def test_registered_methods_name_modules_with_a_train_function():
    """The registry names each shipped method's module, imported only when the method runs (so the
    config needs no torch): each is an align module whose `train` the stage calls."""
    for name, method in align.METHODS.items():
        assert method == f"gristmill.tasks.align.{name}", name
        assert align.train_function(method).__module__ == method, name


def test_a_new_method_is_a_section_a_train_function_and_a_registry_entry(tmp_path, tiny_model_dir,
                                                                         monkeypatch):
    """What a method provides (a config section with sources(), train(config, job)) plus its
    METHODS entry is all the stage needs: hashing, dispatch and export follow."""

    class ScaleConfig(StageConfig):
        factor: float = Field(1.0, gt=0, description="Multiplies the output embedding.")

        def sources(self) -> list[str]:
            return []

    class Config(align.Config):
        method: Literal["dpo", "grpo", "ppo", "scale"] = "dpo"
        scale: ScaleConfig = Field(default_factory=ScaleConfig, description="Settings of the test method.")

    def train(config: ScaleConfig, job: AlignJob):
        with torch.no_grad():
            job.model.lm_head.weight.mul_(config.factor)
        return job.model, {"scaled_by": config.factor}

    monkeypatch.setattr(align, "METHODS", {**align.METHODS, "scale": train})
    config = Config(method="scale", scale={"factor": 2.0})
    assert config.hashed_dict() == {"lora": None, "method": "scale", "scale": {"factor": 2.0}}
    assert fingerprint(config) == fingerprint(Config(method="scale"))
    s = run_align(config, sft_inputs(tmp_path, tiny_model_dir), tmp_path / "out").stats
    assert s["method"] == "scale" and s["scaled_by"] == 2.0
    before, after = weights(tiny_model_dir), weights(tmp_path / "out" / "model")
    head = next(k for k in before if "lm_head" in k or "embed_tokens" in k)
    assert torch.allclose(after[head], 2.0 * before[head])
    with pytest.raises(ValidationError, match="method"):
        align.Config(method="scale")  # not in the shipped registry


# ---------------------------------------------------------------- the stage

DPO = dict(max_pairs=96, beta=0.1, heldout_fraction=0.25, max_steps=20, batch_size=8, lr=5e-3, max_seq_len=64,
           warmup_frac=0.1, seed=0, device="cpu", checkpoint_every=10, **TRL_ADAMW)


def dpo_config(lora: dict | None = None, **dpo) -> align.Config:
    return align.Config(method="dpo", dpo={**DPO, **dpo}, lora=lora)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def arithmetic_run(tmp_path_factory, tiny_model_dir):
    """One uninterrupted DPO run on demo:arithmetic: (inputs, out_dir, stats)."""
    root = tmp_path_factory.mktemp("align")
    inputs = sft_inputs(root, tiny_model_dir)
    result = run_align(dpo_config(), inputs, root / "align.partial")
    return inputs, root / "align.partial", result.stats


def test_dpo_stage_trains_and_exports(arithmetic_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    inputs, out, s = arithmetic_run
    assert s["steps"] == 20 and s["resumed_from_step"] == 0
    assert s["pairs_train"] + s["pairs_heldout"] + s["dropped_prompt_too_long"] == 96
    assert s["pairs_heldout"] == 24 and s["dropped_prompt_too_long"] == 0
    assert s["truncated_too_long"] == 0 and s["method"] == "dpo"
    # before training the policy is the reference: implicit rewards are exactly 0
    assert s["heldout_margin_before"] == 0.0 and s["heldout_pref_acc_before"] == 0.0
    assert 0.0 <= s["heldout_logp_acc_before"] <= 1.0

    before, after = weights(inputs["sft"].path / "model"), weights(out / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (out / "checkpoints").exists()

    logged = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(1, 21))
    assert {"loss", "rewards/margins", "rewards/accuracies"} <= logged[-1].keys()
    assert logged[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy == reference

    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


def test_heldout_margin_grows_on_a_learnable_preference(tmp_path, tiny_model_dir):
    """A random tiny model cannot learn arithmetic in a few steps, so held-out gains are checked on
    pairs whose preference generalises: a courteous reply over a curt one, whatever the prompt."""
    pairs, _ = load_preference_pairs("demo:arithmetic", 48)
    path = tmp_path / "courtesy.jsonl"
    path.write_text("".join(json.dumps({"prompt": p["prompt"], "chosen": "Gladly, here it is.",
                                        "rejected": "No. Go away."}) + "\n" for p in pairs))
    config = dpo_config(data=[str(path)], max_steps=10, checkpoint_every=100)
    s = run_align(config, sft_inputs(tmp_path, tiny_model_dir), tmp_path / "out").stats
    assert s["pairs_heldout"] == 12
    assert s["heldout_margin_after"] > s["heldout_margin_before"] + 1.0
    assert s["heldout_pref_acc_after"] == 1.0 > s["heldout_pref_acc_before"]
    assert s["heldout_logp_acc_after"] == 1.0


def test_killed_stage_resumes_from_checkpoint(tmp_path, tiny_model_dir, arithmetic_run, kill_at_metrics_step):
    inputs, out = sft_inputs(tmp_path, tiny_model_dir), tmp_path / "align.partial"
    config = dpo_config()
    kill_at_metrics_step(15)
    with pytest.raises(KeyboardInterrupt):
        run_align(config, inputs, out)
    assert (out / "checkpoints" / "checkpoint-10").is_dir()
    assert not (out / "model").exists()
    kill_at_metrics_step(None)

    stats = run_align(config, inputs, out).stats
    assert stats["resumed_from_step"] == 10 and stats["steps"] == 20
    # steps 11-14 of the killed run were dropped and redone once: no step twice, none missing
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 21))
    # resuming restores weights, optimizer, schedule and data order: same model as never stopping
    resumed, uninterrupted = weights(out / "model"), weights(arithmetic_run[1] / "model")
    assert all(torch.allclose(resumed[k], uninterrupted[k], atol=1e-5) for k in uninterrupted)


def test_overlong_pairs_are_truncated_or_dropped_and_counted(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"Question {i}?", "chosen": "Yes, gladly.", "rejected": "No."} for i in range(12)]
    rows += [{"prompt": "Tell me more.", "chosen": "word " * 200, "rejected": "No."}] * 2  # long reply
    rows += [{"prompt": "ramble " * 200, "chosen": "Yes.", "rejected": "No."}] * 2  # prompt fills it
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = dpo_config(data=[str(path)], max_steps=2)
    s = run_align(config, sft_inputs(tmp_path, tiny_model_dir), tmp_path / "out").stats
    assert s["dropped_prompt_too_long"] == 2
    assert s["pairs_train"] + s["pairs_heldout"] == 14
    assert 0 <= s["truncated_too_long"] <= 2 and s["truncated_too_long"] + s["pairs_heldout"] >= 2


def test_the_sft_term_of_two_ranks_is_the_one_process_term(tmp_path, tiny_model_dir, monkeypatch):
    """DPO with `sft_weight` on two data-parallel ranks, each holding half a step's pairs: the
    average of their losses (what data parallelism averages, gradients included) is the loss one
    process computes on the whole batch, as the ranks' SFT terms are weighted by their shares of the
    batch's chosen tokens. TRL's own term (each rank's mean over its own chosen tokens) is not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gristmill.tasks.align.dpo as dpo
    from gristmill.tasks.align.preferences import load_pairs, split_heldout

    config = DPOConfig(**{**DPO, "sft_weight": 1.0})
    pairs, _ = load_pairs(config.data, config.max_pairs, config.seed)
    job = AlignJob(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                   tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), out_dir=tmp_path, store_mapping=None,
                   lora=None)
    trainer = dpo.build_trainer(config, job, *split_heldout(pairs, config.heldout_fraction, config.seed))
    rows = [trainer.train_dataset[i] for i in range(config.batch_size)]
    whole, *halves = (trainer.data_collator(part) for part in (rows, rows[:4], rows[4:]))
    chosen = [half["completion_mask"][:, 1:].chunk(2)[0].sum() for half in halves]
    assert chosen[0] != chosen[1]  # the halves hold different numbers of chosen tokens

    def loss(batch: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, batch).item()

    class TwoRanks(Ranks):  # what the all-reduce of two ranks, each holding a half, sums
        def total(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (sum(chosen).float(),)

    one = loss(whole)
    monkeypatch.setattr(Ranks, "of_launch", classmethod(lambda cls, device: TwoRanks(0, 2)))
    assert (loss(halves[0]) + loss(halves[1])) / 2 == pytest.approx(one, abs=1e-6)
    # each rank's own mean, as TRL has it
    monkeypatch.setattr(Ranks, "of_launch", classmethod(lambda cls, device: Ranks(0, 1)))
    assert (loss(halves[0]) + loss(halves[1])) / 2 != pytest.approx(one, abs=1e-5)  # 7e-5 off on this batch


def test_dpo_with_lora_uses_the_adapter_free_model_as_reference(tmp_path, tiny_model_dir):
    config = dpo_config(max_steps=4, lora={"rank": 4})
    s = run_align(config, sft_inputs(tmp_path, tiny_model_dir), tmp_path / "out").stats
    assert s["heldout_margin_before"] == 0.0  # adapters start at zero: policy == reference
    assert s["heldout_margin_after"] != 0.0
    assert 0 < s["params_trainable"] < s["params_total"] / 2
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    before, after = weights(tiny_model_dir), weights(tmp_path / "out" / "model")
    assert set(before) == set(after)  # merged export: plain weights, no adapter names
    assert any(not torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------- the report

def test_evaluate_summarises_the_align_stages_heldout_numbers():
    import gristmill.tasks.evaluate.stage as evaluate

    stats = {"method": "grpo", "prompts_heldout": 186, "steps": 40, "train_loss": 0.1,
             "heldout_accuracy_before": 0.14, "heldout_accuracy_after": 0.25,
             "heldout_format_before": 0.3, "heldout_format_after": 1.0,
             "heldout_only_before": 1.0, "dropped_prompt_too_long": 0}
    summary = evaluate.alignment_summary(stats)
    assert summary == {"method": "grpo", "prompts_heldout": 186, "steps": 40,
                       "heldout": {"accuracy": {"before": 0.14, "after": 0.25},
                                   "format": {"before": 0.3, "after": 1.0}}}
    assert evaluate.alignment_summary({"method": "dpo", "steps": 3}) == {}


# ---------------------------------------------------------------- ppo (reward model + PPO)

def _courtesy_pairs(path: Path, n: int) -> Path:
    """Pairs whose preference generalises across prompts: a courteous reply over a curt one."""
    pairs, _ = load_preference_pairs("demo:arithmetic", n)
    path.write_text("".join(json.dumps({"prompt": p["prompt"], "chosen": "Gladly, here it is.",
                                        "rejected": "No. Go away."}) + "\n" for p in pairs))
    return path


def test_ppo_stage_trains_a_reward_model_then_the_policy(tmp_path, tiny_model_dir):
    data = _courtesy_pairs(tmp_path / "courtesy.jsonl", 40)
    ppo = {"data": [str(data)], "heldout_fraction": 0.25,
           "reward_model": {"lr": 1e-3, "max_steps": 15, "batch_size": 8, "max_seq_len": 64, "device": "cpu",
                            **TRL_ADAMW},
           "policy": {"batch_size": 8, "minibatch_size": 4, "ppo_epochs": 2, "max_new_tokens": 6,
                      "lr": 1e-3, "max_steps": 6, "kl_coef": 0.05, "checkpoint_every": 3, "device": "cpu",
                      "warmup_frac": 0.0, **TRL_ADAMW}}
    config = align.Config(method="ppo", ppo=ppo)
    inputs = sft_inputs(tmp_path, tiny_model_dir)
    s = run_align(config, inputs, tmp_path / "out").stats
    assert s["method"] == "ppo" and s["prompts_train"] == 30 and s["prompts_heldout"] == 10
    assert s["heldout_rm_accuracy_after"] == 1.0 and s["heldout_rm_margin_after"] > s["heldout_rm_margin_before"]
    assert s["ppo_steps"] == 6 and math.isfinite(s["ppo_kl_final"])
    assert math.isfinite(s["heldout_rm_score_before"]) and math.isfinite(s["heldout_rm_score_after"])
    before, after = weights(inputs["sft"].path / "model"), weights(tmp_path / "out" / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "out" / "reward_model" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "checkpoints").exists()
    logged = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert any("ppo/kl" in row for row in logged) and any("rm/loss" in row for row in logged)
    with pytest.raises(ValueError, match="lora"):
        run_align(config.model_copy(update={"lora": {"rank": 4}}), inputs, tmp_path / "lora")
