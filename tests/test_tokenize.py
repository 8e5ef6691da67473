"""Tokenizer round trips on real multilingual text, chat rendering with its loss mask, and the
tokenize stage on a small fake collect output."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from tasks import tokenize
from tasks.chat import CHAT_TEMPLATE, SPECIAL_TOKENS, render_with_mask
from tasks.stage import Manifest, SerialEngine


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def _samples(shared_data: Path) -> dict[str, str]:
    lingua = shared_data / "multilingual" / "lingua_sentences"
    samples = {
        "shakespeare": (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[500_000:520_000],
        "japanese": (shared_data / "corpus" / "wagahaiwa_nekodearu_ja.txt").read_text(encoding="utf-8")[:5000],
    }
    for code in ("ar", "el", "ru", "zh", "ko", "hi"):
        samples[code] = (lingua / f"{code}.txt").read_text(encoding="utf-8")[:3000]
    samples["odd"] = "tabs\tand  double spaces\r\nemoji 🧪 \x00 nul, combining é"
    return samples


def test_round_trip_is_lossless_on_real_text(tok, shared_data):
    samples = _samples(shared_data)
    for name, text in samples.items():
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, name
        assert tok.unk_token_id is None or tok.unk_token_id not in ids


def test_trained_tokenizer_compresses_its_training_language(tok, shared_data):
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[:20_000]
    ids = tok.encode(text, add_special_tokens=False)
    # BPE with 1k merges on this text should do clearly better than one token per byte.
    assert len(text.encode()) / len(ids) > 2.0


def test_special_tokens_are_single_ids_and_nothing_is_added(tok):
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tok.encode(token, add_special_tokens=False) == [token_id]
    assert tok.bos_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|pad|>"
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)
    assert tok.chat_template == CHAT_TEMPLATE


def test_chat_template_and_assistant_mask(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "The answer is 5."},
                {"role": "user", "content": "And 4 - 1?"},
                {"role": "assistant", "content": "The answer is 3."}]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                        "<|im_start|>assistant\nThe answer is 5.<|im_end|>\n"
                        "<|im_start|>user\nAnd 4 - 1?<|im_end|>\n"
                        "<|im_start|>assistant\nThe answer is 3.<|im_end|>\n")
    ids, mask = render_with_mask(tok, messages)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert tok.decode(ids) == rendered
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "The answer is 5.<|im_end|>The answer is 3.<|im_end|>"
    # Exactly two contiguous masked spans, each ending in <|im_end|>.
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    assert len(starts) == 2


def test_split_is_deterministic_and_near_the_fraction():
    ids = [f"doc-{i}" for i in range(4000)]
    first = [tokenize.is_val(i, 0.1) for i in ids]
    assert first == [tokenize.is_val(i, 0.1) for i in ids]
    assert 0.08 < sum(first) / len(ids) < 0.12


def test_config_validation_names_the_field():
    with pytest.raises(ValidationError, match="val_fraction"):
        tokenize.Config(val_fraction=0.0)
    with pytest.raises(ValidationError, match="vocab_size"):
        tokenize.Config(vocab_size=100)
    with pytest.raises(ValidationError, match="min_frequency"):
        tokenize.Config(min_frequency=0)
    with pytest.raises(ValidationError):
        tokenize.Config(vocab_sise=512)
    assert "encode_batch_docs" not in tokenize.Config().hashed_dict()


# --- stage run ----------------------------------------------------------------------------------

def _fake_collect(root: Path, shared_data: Path) -> tuple[Manifest, dict[str, str]]:
    """Two shards of real documents: Shakespeare chunks and a few non-English ones."""
    shakespeare = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()
    docs = [{"id": f"shk-{i}", "text": shakespeare[i * 1500:(i + 1) * 1500]} for i in range(60)]
    lingua = shared_data / "multilingual" / "lingua_sentences"
    for code in ("de", "fr", "ru", "ja"):
        text = (lingua / f"{code}.txt").read_text(encoding="utf-8")[:1500]
        docs.append({"id": f"lingua-{code}", "text": text})
    (root / "docs").mkdir(parents=True)
    for shard, chunk in enumerate((docs[::2], docs[1::2])):
        with gzip.open(root / "docs" / f"part-{shard:05d}.jsonl.gz", "wt", encoding="utf-8") as f:
            for d in chunk:
                f.write(json.dumps({**d, "source": "test", "url": f"https://example.org/{d['id']}"}) + "\n")
    manifest = Manifest(stage="collect", key="collect-test", path=root, config={}, upstream={},
                        files={}, stats={})
    return manifest, {d["id"]: d["text"] for d in docs}


def _split_docs(ids: np.ndarray, sep_id: int) -> list[list[int]]:
    ends = np.flatnonzero(ids == sep_id)
    assert len(ends) and ends[-1] == len(ids) - 1  # every document ends with the separator
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[s:e].tolist() for s, e in zip(starts, ends)]


def test_stage_run_writes_consistent_bins(tmp_path, shared_data):
    collect, texts = _fake_collect(tmp_path / "collect", shared_data)
    config = tokenize.Config(vocab_size=600, val_fraction=0.2, encode_batch_docs=7)
    out = tmp_path / "out"
    result = tokenize.run(config, {"collect": collect}, out, engine=SerialEngine())

    meta = json.loads((out / "tokens" / "meta.json").read_text())
    assert set(meta) == {"dtype", "vocab_size", "train_tokens", "val_tokens", "train_docs",
                         "val_docs", "val_bytes"}
    assert meta["dtype"] == "uint16" and meta["vocab_size"] <= 600
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert len(tok) == meta["vocab_size"] and tok.chat_template == CHAT_TEMPLATE
    sep_id = tok.convert_tokens_to_ids("<|endoftext|>")

    decoded = {}
    for split in ("train", "val"):
        path = out / "tokens" / f"{split}.bin"
        assert path.stat().st_size / np.dtype(meta["dtype"]).itemsize == meta[f"{split}_tokens"]
        docs = _split_docs(np.fromfile(path, dtype=meta["dtype"]), sep_id)
        assert len(docs) == meta[f"{split}_docs"]
        decoded[split] = {tok.decode(d) for d in docs}
    assert meta["train_docs"] + meta["val_docs"] == len(texts)
    assert meta["val_docs"] > 0 and meta["train_docs"] > 0
    assert decoded["train"].isdisjoint(decoded["val"])
    val_texts = [t for i, t in texts.items() if tokenize.is_val(i, 0.2)]
    assert decoded["val"] == set(val_texts)
    assert meta["val_bytes"] == sum(len(t.encode()) for t in val_texts)

    assert result.stats["val_tokens"] == meta["val_tokens"]
    assert result.stats["bytes_per_token"] == pytest.approx(meta["val_bytes"] / meta["val_tokens"])
    assert result.artifacts == ["tokens/meta.json"]
    assert not (out / "parts").exists()

    again = tmp_path / "again"
    tokenize.run(config, {"collect": collect}, again, engine=SerialEngine())
    for rel in ("tokens/train.bin", "tokens/val.bin", "tokens/meta.json", "tokenizer/tokenizer.json"):
        assert (out / rel).read_bytes() == (again / rel).read_bytes(), rel
