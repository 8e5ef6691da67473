"""SFT: conversation loading (formats, OpenAssistant trees), the exact assistant-only label mask,
packing (positions, per-example attention, loss), LoRA (only adapters train, merged export), the
held-out split, exact resume, pretraining text mixed into the batches, and short stage runs that
lower held-out assistant-token loss."""
from __future__ import annotations

import gzip
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import untimed
from transformers import AutoModelForCausalLM, AutoTokenizer

import gristmill.tasks.sft.stage as sft
from gristmill.core.chat import render_with_mask
from gristmill.core.stage import Manifest, SerialEngine, read_metrics
from gristmill.model.config import LoraConfig
from gristmill.model.loop import IGNORE_INDEX, causal_lm_loss, token_loss_sum
from gristmill.model.lora import apply_lora
from gristmill.model.packing import collate_packed, pack_examples, packed_logits
from gristmill.tasks.sft.config import fingerprint
from gristmill.tasks.sft.conversations import drop_reason, load_conversations, oasst_threads

N = None  # an unscored label position, in the spelled-out expectations below


def _write_jsonl(path: Path, records: list) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


# --- labels -----------------------------------------------------------------------------------

def test_label_mask_is_exact_on_a_rendered_conversation(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Good day."}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Farewell."}]
    ids, mask = render_with_mask(tok, conv)
    # The tiny BPE is trained in-process on tinyshakespeare, so its pieces are fixed.
    assert tok.convert_ids_to_tokens(ids) == [
        "<|im_start|>", "s", "y", "st", "em", "Ċ", "Be", "Ġb", "ri", "ef", ".", "<|im_end|>", "Ċ",
        "<|im_start|>", "us", "er", "Ċ", "H", "i", "<|im_end|>", "Ċ",
        "<|im_start|>", "ass", "ist", "ant", "Ċ", "G", "ood", "Ġday", ".", "<|im_end|>", "Ċ",
        "<|im_start|>", "us", "er", "Ċ", "By", "e", "<|im_end|>", "Ċ",
        "<|im_start|>", "ass", "ist", "ant", "Ċ", "F", "are", "well", ".", "<|im_end|>", "Ċ"]
    inputs, labels = sft.sft_example(ids, mask)
    assert inputs == ids[:-1]
    # Position t is scored on ids[t + 1] only when that is an assistant token (content + <|im_end|>).
    expected = ([N] * 25 + ["G", "ood", "Ġday", ".", "<|im_end|>"] + [N] * 14
                + ["F", "are", "well", ".", "<|im_end|>"] + [N])
    assert [tok.convert_ids_to_tokens(t) if t != IGNORE_INDEX else N for t in labels] == expected


def test_truncation_is_counted_and_answerless_examples_dropped(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    long_question = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    long_answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "so " * 100}]
    examples, kept, counts = sft.encode_conversations(tok, [long_question, short, long_answer], max_seq_len=32)
    assert counts == {"truncated_over_max_seq_len": 2, "dropped_no_assistant_tokens_after_truncation": 1}
    assert kept == [1, 2] and len(examples[1][0]) == 31  # cut to 32 tokens, then shifted by one


def test_collate_pads_right_and_masks_padding():
    batch = sft.collate([([5, 6, 7], [IGNORE_INDEX, 7, 8]), ([9], [4])], pad_id=1)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 1, 1]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 7, 8], [4, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_epoch_indices_cover_each_example_once_per_epoch():
    first_epoch = [i for step in range(5) for i in sft.epoch_indices(step, 2, 10, seed=3)]
    assert sorted(first_epoch) == list(range(10))
    assert sft.epoch_indices(7, 2, 10, seed=3) == sft.epoch_indices(7, 2, 10, seed=3)
    assert first_epoch != [i for step in range(5, 10) for i in sft.epoch_indices(step, 2, 10, seed=3)]


# --- packing ----------------------------------------------------------------------------------

def test_packed_rows_keep_labels_and_restart_positions():
    X = IGNORE_INDEX
    examples = [([1, 2, 3], [X, 3, 4]), ([5, 6], [6, 7]), ([8], [9])]
    rows = pack_examples(examples, max_seq_len=4)
    # Best fit decreasing: the 3-token example, then the 1-token one fills its row.
    assert rows == [([1, 2, 3, 8], [X, 3, 4, 9], [3, 1]), ([5, 6], [6, 7], [2])]
    batch = collate_packed(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 8], [5, 6, 0, 0]]
    assert batch["labels"].tolist() == [[X, 3, 4, 9], [6, 7, X, X]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]  # padding: a run of its own
    assert "attention_mask" not in batch
    with pytest.raises(ValueError, match="max_seq_len=2"):
        pack_examples(examples, max_seq_len=2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_examples_do_not_see_each_other(tiny_model_dir, tiny_tokenizer_dir, attn):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in
             [("What is 2 + 3?", "5."), ("Name a king.", "Richard the Third."), ("Hi", "Good morrow, sir.")]]
    examples = [sft.sft_example(*render_with_mask(tok, c)) for c in convs]
    rows = pack_examples(examples, max_seq_len=128)
    assert len(rows) == 1 and len(rows[0][2]) == 3  # all three in one row
    packed = collate_packed(rows, tok.pad_token_id)
    with torch.no_grad():
        logits = packed_logits(model, packed)[0]
        start = 0
        for length in rows[0][2]:
            ids = torch.tensor([rows[0][0][start : start + length]])
            alone = model(input_ids=ids).logits[0]
            assert torch.allclose(logits[start : start + length], alone, atol=1e-5)
            start += length
        # The same row without restarting positions lets later examples attend to earlier ones.
        leaky = model(input_ids=packed["input_ids"]).logits[0]
        assert not torch.allclose(leaky[rows[0][2][0]:], logits[rows[0][2][0]:], atol=1e-3)
        # Summed loss of the packed batch = the sum of each example's loss run alone (padded batch).
        packed_sum, packed_count = token_loss_sum(model, packed)
        alone_sums = [token_loss_sum(model, sft.collate([e], tok.pad_token_id)) for e in examples]
    assert torch.allclose(packed_sum, sum(s for s, _ in alone_sums), atol=1e-4)
    assert int(packed_count) == sum(int(n) for _, n in alone_sums) > 0


# --- held-out split ---------------------------------------------------------------------------

def test_heldout_split_keeps_groups_together():
    groups = ["a", "a", "a", "b", "c", "d", "d", "e", "f", "g"]
    train, heldout = sft.split_heldout(groups, 0.3, seed=0)
    assert sorted(train + heldout) == list(range(10)) and len(heldout) >= 3
    assert {groups[i] for i in train}.isdisjoint({groups[i] for i in heldout})
    assert sft.split_heldout(groups, 0.3, seed=0) == (train, heldout)
    assert sft.split_heldout(["x", "x"], 0.5, seed=0) == ([0, 1], [])  # never empties training
    thread = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    longer = [*thread, {"role": "user", "content": "more"}, {"role": "assistant", "content": "B"}]
    assert sft.conversation_group(thread) == sft.conversation_group(longer)


# --- conversation sources ---------------------------------------------------------------------

def test_demo_arithmetic_source():
    convs, dropped = load_conversations("demo:arithmetic", limit=20)
    assert len(convs) == 20 and dropped == {}
    assert convs[0][0]["role"] == "user" and convs[0][1]["content"].startswith("The answer is ")
    with pytest.raises(ValueError, match="demo:unknown"):
        load_conversations("demo:unknown", limit=5)


def test_self_instruct_seed_tasks_are_detected(shared_data):
    convs, dropped = load_conversations(str(shared_data / "sft" / "self_instruct_seed_tasks.jsonl"), None)
    assert len(convs) == 175 and dropped == {}  # one instance per seed task
    antonyms = next(c for c in convs if c[0]["content"].startswith("What is the relation between"))
    assert antonyms[0]["content"].endswith("\n\nNight : Day :: Right : Left")
    assert antonyms[1] == {"role": "assistant",
                           "content": "The relation between the given pairs is that they are opposites."}


def test_messages_jsonl_with_bad_records(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl.gz", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "Anyone there?"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "x"}]},
        {"text": "plain pretraining text"},
    ])
    convs, dropped = load_conversations(str(path), None)
    assert [m["role"] for m in convs[0]] == ["system", "user", "assistant"] and len(convs) == 1
    assert dropped == {"no_assistant_turn": 1, "empty_assistant_content": 1, "malformed_message": 1,
                       "unknown_format": 1}


def test_prompt_response_and_completion_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "Name a colour.", "response": "Blue."},
        {"prompt": "Name a fruit.", "completion": "Apple."},
        {"prompt": [{"role": "user", "content": "Count to 2."}],
         "completion": [{"role": "assistant", "content": "1, 2."}]},
        {"prompt": "Say nothing.", "response": ""},
    ])
    convs, dropped = load_conversations(str(path), limit=None)
    assert convs == [
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
        [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."}],
        [{"role": "user", "content": "Count to 2."}, {"role": "assistant", "content": "1, 2."}],
    ]
    assert dropped == {"empty_assistant_content": 1}
    assert len(load_conversations(str(path), limit=2)[0]) == 2


def _msg(mid, parent, role, text, rank=None, **extra):
    return {"message_id": mid, "parent_id": parent, "role": role, "text": text, "rank": rank,
            "deleted": False, "review_result": True, "synthetic": False, **extra}


def test_oasst_trees_flatten_to_every_thread(tmp_path):
    records = [
        _msg("p", None, "prompter", "Q1"),
        _msg("a2", "p", "assistant", "second best", rank=1),
        _msg("a1", "p", "assistant", "best", rank=0),
        _msg("f", "a1", "prompter", "follow-up"),
        _msg("a3", "f", "assistant", "A3"),
        _msg("u", "a1", "prompter", "unanswered follow-up"),  # cut back: adds Q1/best once
        _msg("ax", "p", "assistant", "spam", rank=2, deleted=True),
        _msg("ay", "ax", "prompter", "reply to deleted"),
        _msg("r", "p", "assistant", "rejected", review_result=False),
        _msg("s", "p", "assistant", "synthetic", synthetic=True),
        _msg("o", "missing", "assistant", "orphan"),
        _msg("q", None, "prompter", "nobody answered"),
    ]
    threads, dropped = oasst_threads(records)
    u, a = "user", "assistant"
    assert [[(m["role"], m["content"]) for m in t] for t in threads] == [
        [(u, "Q1"), (a, "best"), (u, "follow-up"), (a, "A3")],
        [(u, "Q1"), (a, "best")],
        [(u, "Q1"), (a, "second best")],
        [(u, "nobody answered")],
    ]
    assert dropped == {"deleted_message": 1, "failed_review_message": 1, "synthetic_message": 1,
                       "unreachable_message": 2}  # the reply to the deleted one, and the orphan
    path = _write_jsonl(tmp_path / "oasst.jsonl", records)
    convs, counts = load_conversations(str(path), None)
    assert len(convs) == 3 and counts["no_assistant_turn"] == 1 and counts["unreachable_message"] == 2


def test_real_openassistant_export_is_detected(shared_data):
    convs, dropped = load_conversations(str(shared_data / "sft" / "oasst1_en_validation.jsonl"), None)
    # 2022 messages: 40 deleted, 46 more failed review; 188 trees flatten to 914 distinct threads.
    assert len(convs) == 914 and dropped == {"deleted_message": 40, "failed_review_message": 46}
    assert convs[0][:1] == [{"role": "user", "content": "What do you think about ChatGPT?"}]
    assert all(c[-1]["role"] == "assistant" and [m["role"] for m in c] == ["user", "assistant"] * (len(c) // 2)
               for c in convs)


def test_empty_source_is_an_error_naming_it(tmp_path, tiny_tokenizer_dir):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "?"}]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl"):
        load_conversations(str(path), None)
    assert drop_reason([]) == "empty_conversation"
    # Usable records whose answers all fall beyond max_seq_len: empty after truncation.
    late = _write_jsonl(tmp_path / "late.jsonl", [{"prompt": "word " * 100, "response": "ok"}])
    config = sft.Config(data=["demo:arithmetic", str(late)], max_examples=5, max_seq_len=64)
    with pytest.raises(ValueError, match=r"late\.jsonl"):
        sft.load_examples(config, AutoTokenizer.from_pretrained(tiny_tokenizer_dir))


# --- LoRA -------------------------------------------------------------------------------------

def test_lora_trains_only_adapters(tiny_model_dir):
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # 2 layers x 7 linear modules x (A, B)
    assert len(trainable) == 28 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    with pytest.raises(ValueError, match="nope"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(target_modules=["nope"]))


# --- the stage --------------------------------------------------------------------------------

@pytest.fixture
def pretrain_manifest(tmp_path, tiny_model_dir) -> Manifest:
    shutil.copytree(tiny_model_dir, tmp_path / "pretrain" / "model")
    return Manifest(stage="pretrain", key="test", path=tmp_path / "pretrain", config={}, upstream={},
                    files={}, stats={})


@pytest.fixture(scope="module")
def tokenize_manifest(tmp_path_factory, tiny_tokenizer_dir, shared_data) -> Manifest:
    """A tokenize artifact's token streams (tokens/{train,val}.bin + meta.json): real text encoded
    with the tiny tokenizer, documents separated by <|endoftext|>."""
    import numpy as np

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[:120_000]
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = [t for i in range(0, len(text), 4000) for t in [*tok.encode(text[i : i + 4000]), sep]]
    root = tmp_path_factory.mktemp("tokenize")
    (root / "tokens").mkdir()
    cut = int(0.9 * len(ids))
    for split, part in (("train", ids[:cut]), ("val", ids[cut:])):
        np.asarray(part, dtype=np.uint16).tofile(root / "tokens" / f"{split}.bin")
    (root / "tokens" / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    return Manifest(stage="tokenize", key="test", path=root, config={}, upstream={}, files={}, stats={})


def test_sft_lowers_heldout_assistant_loss(pretrain_manifest, tokenize_manifest, tmp_path):
    config = sft.Config(data=["demo:arithmetic"], max_examples=200, max_steps=30, batch_size=8,
                        lr=3e-3, warmup_frac=0.1, heldout_fraction=0.1, eval_every=15,
                        checkpoint_every=15, device="cpu")
    out = tmp_path / "sft"
    inputs = {"pretrain": pretrain_manifest, "tokenize": tokenize_manifest}
    result = sft.run(config, out, engine=SerialEngine(), store_mapping=None, **inputs)
    stats = result.stats
    assert stats["examples_heldout"] == 20 and stats["examples_train"] == 180
    assert stats["heldout_loss_after"] < 0.5 * stats["heldout_loss_before"]
    heldout_curve = [r["heldout_loss"] for r in read_metrics(out / "metrics.jsonl") if "heldout_loss" in r]
    assert len(heldout_curve) == 2 and heldout_curve[-1] == stats["heldout_loss_after"]
    assert stats["steps"] == 30 and stats["resumed_from_step"] == 0
    assert stats["params_trainable"] == stats["params_total"] and not (out / "adapter").exists()
    assert stats["text_tokens_seen"] == 30 * config.pretrain_windows * config.max_seq_len

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(pretrain_manifest.path / "model")
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert AutoTokenizer.from_pretrained(out / "model").chat_template


def test_mixed_batches_carry_pretraining_windows_and_weight_the_loss(tiny_model_dir, tokenize_manifest):
    """Each step's batch adds pretrain_windows windows of max_seq_len tokens (a pure function of
    the step), and the loss is (1 - mix) * assistant loss + mix * next-token loss on them."""
    import numpy as np

    config = sft.Config(pretrain_mix=0.3, pretrain_windows=2, max_seq_len=32, batch_size=2, device="cpu")
    text = np.fromfile(tokenize_manifest.path / "tokens" / "train.bin", dtype=np.uint16)
    examples = [([1, 2, 3], [IGNORE_INDEX, 3, 4]), ([5, 6], [6, 7]), ([8, 9], [9, 10])]
    get_batch, loss_fn, _, _ = sft.batch_source(config, examples, pad_id=0, text=text)
    batch = get_batch(4)
    assert batch["text_input_ids"].shape == batch["text_labels"].shape == (2, 32)
    assert torch.equal(batch["text_input_ids"][:, 1:], batch["text_labels"][:, :-1])
    assert all(torch.equal(batch[k], get_batch(4)[k]) for k in batch)
    assert not torch.equal(batch["text_input_ids"], get_batch(5)["text_input_ids"])

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    convs = {k: v for k, v in batch.items() if not k.startswith("text_")}
    text_part = {"input_ids": batch["text_input_ids"], "labels": batch["text_labels"]}
    with torch.no_grad():
        expected = 0.7 * causal_lm_loss(model, convs) + 0.3 * causal_lm_loss(model, text_part)
        assert torch.allclose(loss_fn(model, batch), expected)
    only_convs, plain_loss, _, _ = sft.batch_source(config.model_copy(update={"pretrain_mix": 0.0}),
                                                    examples, pad_id=0, text=text)
    assert "text_input_ids" not in only_convs(4) and plain_loss is causal_lm_loss


def test_pretraining_text_keeps_the_models_language(pretrain_manifest, tokenize_manifest, tmp_path):
    """Same SFT run with and without text mixed in: the text keeps next-token loss on held-out text
    below where conversations alone leave it, while the assistant loss still falls."""
    inputs = {"pretrain": pretrain_manifest, "tokenize": tokenize_manifest}
    stats = {}
    for mix in (0.0, 0.5):
        config = sft.Config(data=["demo:arithmetic"], max_examples=200, max_steps=30, batch_size=8, lr=3e-3,
                            max_seq_len=64, pretrain_mix=mix, eval_every=0, checkpoint_every=100, device="cpu")
        stats[mix] = sft.run(config, tmp_path / str(mix), engine=SerialEngine(), store_mapping=None, **inputs).stats
    assert stats[0.0]["val_text_loss_before"] == stats[0.5]["val_text_loss_before"]
    assert stats[0.5]["val_text_loss_after"] < stats[0.5]["val_text_loss_before"]
    assert stats[0.5]["val_text_loss_after"] < stats[0.0]["val_text_loss_after"] - 0.5  # nats
    assert stats[0.5]["heldout_loss_after"] < 0.7 * stats[0.5]["heldout_loss_before"]
    assert stats[0.0]["text_tokens_seen"] == 0 and stats[0.5]["text_tokens_seen"] == 30 * 2 * 64


def test_mixing_text_needs_the_tokenize_artifact(pretrain_manifest, tmp_path):
    with pytest.raises(ValueError, match=r"pretrain_mix=0\.25 .* 'tokenize'"):
        sft.run(sft.Config(max_examples=20, max_steps=1, device="cpu"), tmp_path / "out",
                engine=SerialEngine(), store_mapping=None, pretrain=pretrain_manifest)
    with pytest.raises(ValueError, match="pretrain_windows \\(3\\) must be a multiple"):
        sft.Config(pretrain_windows=3, batch_size=4, grad_accum_steps=2)
    sft.Config(pretrain_windows=3, batch_size=4, grad_accum_steps=2, pretrain_mix=0)  # nothing mixed in


def _lora_config(**overrides) -> sft.Config:
    values = dict(data=["demo:arithmetic"], max_examples=200, max_steps=30, batch_size=4, lr=1e-2,
                  packing=True, max_seq_len=128, lora=LoraConfig(rank=8, alpha=16, dropout=0.1),
                  heldout_fraction=0.1, eval_every=0, checkpoint_every=10, device="cpu")
    return sft.Config(**{**values, **overrides})


def test_lora_with_packing_exports_merged_model_and_adapter(pretrain_manifest, tmp_path):
    from peft import PeftModel

    out = tmp_path / "sft"
    stats = sft.run(_lora_config(pretrain_mix=0), out, engine=SerialEngine(), store_mapping=None,
                    pretrain=pretrain_manifest).stats
    assert stats["heldout_loss_after"] < stats["heldout_loss_before"] - 0.5  # nats; base embeddings stay frozen
    assert stats["packed_rows"] < stats["examples_train"] and 0.8 < stats["packed_fill"] <= 1
    assert stats["params_trainable"] < 0.2 * stats["params_total"]
    assert not (out / "model" / "adapter_config.json").exists()  # plain model, no peft needed

    base_dir = pretrain_manifest.path / "model"
    base, merged = load_file(base_dir / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.split(".")[-2] in LoraConfig().target_modules for k in changed)
    # The merged export computes what base + adapter computes.
    ids = torch.tensor([sft.sft_example(*render_with_mask(AutoTokenizer.from_pretrained(base_dir), [
        {"role": "user", "content": "What is 7 + 8?"}, {"role": "assistant", "content": "15"}]))[0]])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / "adapter").eval()
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(out / "model").eval()(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)


def test_lora_resume_after_crash_is_exact(pretrain_manifest, tokenize_manifest, tmp_path, monkeypatch,
                                          caplog):
    """With pretraining text mixed in (the default), so its windows resume exactly too; with Muon on
    the adapters' matrices (`optimizer: muon`, available to SFT as to pretraining), whose momentum
    must come back from the checkpoint as AdamW's moments do (tests/model/test_model.py)."""
    config = _lora_config(max_steps=6, checkpoint_every=2, eval_every=3, max_examples=60, optimizer="muon")
    inputs = {"pretrain": pretrain_manifest, "tokenize": tokenize_manifest}
    sft.run(config, tmp_path / "straight", engine=SerialEngine(), store_mapping=None, **inputs)

    real_indices = sft.epoch_indices

    def crashing_indices(step, batch_size, n, seed):
        if step == 3:
            raise RuntimeError("simulated crash")
        return real_indices(step, batch_size, n, seed)

    monkeypatch.setattr(sft, "epoch_indices", crashing_indices)
    with pytest.raises(RuntimeError, match="simulated crash"):
        sft.run(config, tmp_path / "resumed", engine=SerialEngine(), store_mapping=None, **inputs)
    monkeypatch.setattr(sft, "epoch_indices", real_indices)
    with caplog.at_level(logging.INFO, logger="gristmill.sft"):
        stats = sft.run(config, tmp_path / "resumed", engine=SerialEngine(), store_mapping=None, **inputs).stats

    assert "resuming from step 2" in caplog.text and stats["resumed_from_step"] == 2
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert untimed(read_metrics(tmp_path / "resumed" / "metrics.jsonl")) == untimed(straight)
    assert len(straight) == 6 and sum("heldout_loss" in r and "val_text_loss" in r for r in straight) == 2
    for name in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(tmp_path / "straight" / name), load_file(tmp_path / "resumed" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_tokens_per_step_needs_packing(pretrain_manifest, tmp_path):
    config = sft.Config(max_examples=20, max_steps=1, tokens_per_step=1024, batch_size=2, device="cpu",
                        pretrain_mix=0)
    with pytest.raises(ValueError, match="tokens_per_step needs packing"):
        sft.run(config, tmp_path / "out", engine=SerialEngine(), store_mapping=None, pretrain=pretrain_manifest)


def test_lora_and_packing_from_pipeline_overrides():
    from gristmill.flows.config import load_config

    cfg = load_config(None, ["sft.lora.rank=4", "sft.packing=true"]).sft
    assert cfg.packing and cfg.lora == LoraConfig(rank=4) and cfg.lora.alpha == 16
    assert load_config(None, []).sft.lora is None
    assert cfg.hashed_dict()["lora"]["rank"] == 4  # adapter shape is part of the artifact hash


def test_fingerprint_follows_file_contents(tmp_path):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "response": "b"}])
    config = sft.Config(data=["demo:arithmetic", str(path)])
    before = fingerprint(config)
    assert before == fingerprint(config)
    _write_jsonl(path, [{"prompt": "a", "response": "c"}])
    assert fingerprint(config) != before
