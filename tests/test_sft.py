"""SFT: conversation loading and format detection, the assistant-only label mask, a short run."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import tasks.sft as sft
from model.loop import IGNORE_INDEX
from tasks.chat import render_with_mask
from tasks.conversations import drop_reason, load_conversations
from tasks.stage import Manifest, SerialEngine, read_metrics


def _write_jsonl(path: Path, records: list) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


# --- labels -----------------------------------------------------------------------------------

def test_labels_cover_exactly_the_assistant_answer(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    conv = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "The answer is 5."}]
    ids, mask = render_with_mask(tok, conv)
    inputs, labels = sft.sft_example(ids, mask)
    assert inputs == ids[:-1] and len(labels) == len(inputs)
    scored = [t for t in labels if t != IGNORE_INDEX]
    assert tok.decode(scored) == "The answer is 5.<|im_end|>"
    # Each label is the next input token: position t predicts ids[t + 1].
    assert all(lab == ids[t + 1] for t, lab in enumerate(labels) if lab != IGNORE_INDEX)


def test_truncation_is_counted_and_answerless_examples_dropped(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    long_question = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    examples, counts = sft.encode_conversations(tok, [long_question, short], max_seq_len=32)
    assert counts == {"truncated": 1, "dropped_no_assistant_tokens_after_truncation": 1}
    assert len(examples) == 1 and len(examples[0][0]) < 32


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


def test_empty_source_is_an_error_naming_it(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "?"}]}])
    with pytest.raises(ValueError, match="bad.jsonl"):
        load_conversations(str(path), None)
    assert drop_reason([]) == "empty_conversation"


# --- the stage --------------------------------------------------------------------------------

@pytest.fixture
def pretrain_manifest(tmp_path, tiny_model_dir) -> Manifest:
    shutil.copytree(tiny_model_dir, tmp_path / "pretrain" / "model")
    return Manifest(stage="pretrain", key="test", path=tmp_path / "pretrain", config={}, upstream={},
                    files={}, stats={})


def test_sft_lowers_heldout_assistant_loss(pretrain_manifest, tmp_path):
    config = sft.Config(data=["demo:arithmetic"], max_examples=200, max_steps=30, batch_size=8,
                        lr=3e-3, warmup_frac=0.1, heldout_fraction=0.1, eval_every=15,
                        checkpoint_every=15, device="cpu")
    out = tmp_path / "sft"
    result = sft.run(config, {"pretrain": pretrain_manifest}, out, engine=SerialEngine())
    stats = result.stats
    assert stats["examples_heldout"] == 20 and stats["examples_train"] == 180
    assert stats["heldout_loss_after"] < 0.5 * stats["heldout_loss_before"]
    heldout_curve = [r["heldout_loss"] for r in read_metrics(out / "metrics.jsonl") if "heldout_loss" in r]
    assert len(heldout_curve) == 2 and heldout_curve[-1] == stats["heldout_loss_after"]
    assert stats["steps"] == 30 and stats["resumed_from_step"] == 0

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(pretrain_manifest.path / "model")
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert AutoTokenizer.from_pretrained(out / "model").chat_template


def test_fingerprint_follows_file_contents(tmp_path):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "response": "b"}])
    config = sft.Config(data=["demo:arithmetic", str(path)])
    before = sft.fingerprint(config)
    assert before == sft.fingerprint(config)
    _write_jsonl(path, [{"prompt": "a", "response": "c"}])
    assert sft.fingerprint(config) != before
