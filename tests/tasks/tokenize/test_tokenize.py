"""Tokenizer round trips on real multilingual text, chat rendering with its loss mask, and the
tokenize stage on a small fake collect output."""
from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import gristmill.tasks.tokenize.stage as tokenize
from gristmill.core.chat import CHAT_TEMPLATE, SPECIAL_TOKENS, render_with_mask
from gristmill.core.files import iter_jsonl
from gristmill.core.stage import Manifest, SerialEngine, StageResult
from gristmill.tasks.tokenize.config import fingerprint


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


def _read_any_encoding(path: Path) -> str:
    """UTF-8 where the file is UTF-8; else Latin-1, which maps every byte to one character, so
    the round trip still covers every byte of the file (a few corpus files are Latin-1/CP1252)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def test_round_trip_is_lossless_on_every_shared_text_file(tok, shared_data, monkeypatch):
    paths = sorted(p for d in ("corpus", "multilingual") for p in (shared_data / d).rglob("*") if p.is_file())
    texts = [_read_any_encoding(p) for p in paths]
    assert len(paths) > 250 and sum(map(len, texts)) > 5_000_000
    # ~11 MB: the saved tokenizer.json's own batch calls, on all cores, keep this to seconds.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    backend = tok.backend_tokenizer
    ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    decoded = backend.decode_batch(ids, skip_special_tokens=False)
    bad = [str(p) for p, t, d in zip(paths, texts, decoded) if t != d]
    assert bad == []


def test_pre_tokenizer_splits_digits_by_the_configured_group():
    text = "In 1776, 12345 apples cost $3.50 each."
    singles = tokenize.train_tokenizer([text] * 50, vocab_size=300)
    assert [t for t in singles.tokenize("x 12345") if t.isdigit()] == ["1", "2", "3", "4", "5"]
    triples = tokenize.train_tokenizer([text] * 50, vocab_size=300, max_digits_per_token=3)
    assert [t for t in triples.tokenize("x 12345") if t.isdigit()] == ["123", "45"]


def test_reference_vocab_is_gpt2(shared_data):
    enc = tokenize.load_reference(shared_data / "tokenizer" / "gpt2.tiktoken")
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's published ids
    assert enc.n_vocab == 50257 and enc.encode("<|endoftext|>", allowed_special="all") == [50256]


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

INJECTED = "A page quoting a token: <|endoftext|> must stay text, not end the document."


def _fake_collect(root: Path, shared_data: Path) -> tuple[Manifest, dict[str, str]]:
    """Three shards of real documents: Shakespeare chunks, a few non-English ones, and one that
    contains the separator's text."""
    shakespeare = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()
    docs = [{"id": f"shk-{i}", "text": shakespeare[i * 1500:(i + 1) * 1500]} for i in range(60)]
    lingua = shared_data / "multilingual" / "lingua_sentences"
    for code in ("de", "fr", "ru", "ja"):
        text = (lingua / f"{code}.txt").read_text(encoding="utf-8")[:1500]
        docs.append({"id": f"lingua-{code}", "text": text})
    docs.append({"id": "injected", "text": INJECTED})
    (root / "docs").mkdir(parents=True)
    for shard in range(3):
        with gzip.open(root / "docs" / f"part-{shard:05d}.jsonl.gz", "wt", encoding="utf-8") as f:
            for d in docs[shard::3]:
                f.write(json.dumps({**d, "source": "test", "url": f"https://example.org/{d['id']}"}) + "\n")
    manifest = Manifest(stage="collect", key="collect-test", path=root, config={}, upstream={},
                        files={}, stats={})
    return manifest, {d["id"]: d["text"] for d in docs}


def _split_docs(ids: np.ndarray, sep_id: int) -> list[list[int]]:
    ends = np.flatnonzero(ids == sep_id)
    assert len(ends) and ends[-1] == len(ids) - 1  # every document ends with the separator
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[s:e].tolist() for s, e in zip(starts, ends)]


class ReversedEngine:
    """Runs items last-first (as a pool of workers finishing out of order would), results in order."""

    def map(self, fn, items):
        return [fn(item) for item in reversed(items)][::-1]


class CrashingEngine:
    """Finishes `k` items, then dies, as a killed stage would."""

    def __init__(self, k: int):
        self.k = k

    def map(self, fn, items):
        for item in items[: self.k]:
            fn(item)
        raise KeyboardInterrupt("killed")


class RecordingEngine(SerialEngine):
    def __init__(self):
        self.items = []

    def map(self, fn, items):
        self.items += list(items)
        return super().map(fn, items)


OUTPUTS = ("tokens/train.bin", "tokens/val.bin", "tokens/meta.json", "tokens/index.json",
           "tokenizer/tokenizer.json")
CONFIG = {"vocab_size": 600, "val_fraction": 0.2, "encode_batch_docs": 7}


@dataclass(frozen=True, kw_only=True)
class StageRun:
    """One tokenize run on a fake collect output: its input, the input's texts by id, its
    config, its result and its output directory."""

    collect: Manifest
    texts: dict[str, str]
    config: tokenize.Config
    result: StageResult
    out: Path


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory, shared_data) -> StageRun:
    root = tmp_path_factory.mktemp("tokenize")
    collect, texts = _fake_collect(root / "collect", shared_data)
    reference = str(shared_data / "tokenizer" / "gpt2.tiktoken")
    config = tokenize.Config(**CONFIG, reference_vocab=reference)
    result = tokenize.run(config, root / "out", engine=SerialEngine(), collect=collect)
    return StageRun(collect=collect, texts=texts, config=config, result=result, out=root / "out")


def test_stage_run_writes_consistent_bins(stage_run):
    texts, result, out = stage_run.texts, stage_run.result, stage_run.out
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
    assert decoded["train"] | decoded["val"] == set(texts.values())  # incl. the injected separator text
    val_texts = [t for i, t in texts.items() if tokenize.is_val(i, 0.2)]
    assert decoded["val"] == set(val_texts)
    assert meta["val_bytes"] == sum(len(t.encode()) for t in val_texts)
    assert result.stats["val_tokens"] == meta["val_tokens"]
    assert result.artifacts == ["tokens/meta.json", "tokens/index.json"]
    assert not (out / "parts").exists() and not (out / "tokenizer.tmp").exists()


def test_shards_hold_the_tokenizers_own_ids(stage_run):
    """The bins hold exactly what `encode_batch` (with offsets) gives each document, in input
    order, each followed by the separator: the stage's offset-free encoding changes no id."""
    collect, out = stage_run.collect, stage_run.out
    backend = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    backend.encode_special_tokens = True  # as the stage encodes: text never fakes a separator
    sep_id = backend.token_to_id("<|endoftext|>")
    docs = list(iter_jsonl(tokenize.doc_paths(collect.path)))
    encodings = backend.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    for split in ("train", "val"):
        expected = [i for d, e in zip(docs, encodings) if tokenize.is_val(d["id"], 0.2) == (split == "val")
                    for i in (*e.ids, sep_id)]
        meta = json.loads((out / "tokens" / "meta.json").read_text())
        assert np.fromfile(out / "tokens" / f"{split}.bin", dtype=meta["dtype"]).tolist() == expected


def test_index_locates_each_input_shard(stage_run, shared_data):
    out = stage_run.out
    meta = json.loads((out / "tokens" / "meta.json").read_text())
    index = json.loads((out / "tokens" / "index.json").read_text())
    assert [s["input"] for s in index["shards"]] == [f"part-{i:05d}.jsonl.gz" for i in range(3)]
    sep_id = AutoTokenizer.from_pretrained(out / "tokenizer").convert_tokens_to_ids("<|endoftext|>")
    for split in ("train", "val"):
        data = np.fromfile(out / "tokens" / f"{split}.bin", dtype=index["dtype"])
        entries = [s[split] for s in index["shards"]]
        assert [e["offset"] for e in entries] == list(np.cumsum([0] + [e["tokens"] for e in entries[:-1]]))
        assert sum(e["tokens"] for e in entries) == meta[f"{split}_tokens"]
        for e in entries:  # each shard's slice holds exactly its documents
            assert len(_split_docs(data[e["offset"]: e["offset"] + e["tokens"]], sep_id)) == e["docs"]


def test_compression_is_reported_next_to_gpt2(stage_run):
    texts, config, result, out = stage_run.texts, stage_run.config, stage_run.result, stage_run.out
    meta = json.loads((out / "tokens" / "meta.json").read_text())
    stats = result.stats
    text_tokens = meta["val_tokens"] - meta["val_docs"]  # separators cover no text
    assert stats["bytes_per_token"] == pytest.approx(meta["val_bytes"] / text_tokens)
    gpt2 = tokenize.load_reference(config.reference_vocab)
    val_texts = [t for i, t in texts.items() if tokenize.is_val(i, 0.2)]
    gpt2_tokens = sum(len(gpt2.encode_ordinary(t)) for t in val_texts)
    assert stats["reference_bytes_per_token"] == pytest.approx(meta["val_bytes"] / gpt2_tokens)
    assert stats["compression_vs_reference"] == pytest.approx(
        stats["bytes_per_token"] / stats["reference_bytes_per_token"])
    # 600 merges learnt from 100 kB cannot match GPT-2's 50k vocabulary.
    assert 1.5 < stats["bytes_per_token"] < stats["reference_bytes_per_token"] < 6


def test_fingerprint_follows_the_reference_file(tmp_path, shared_data):
    assert fingerprint(tokenize.Config()) is None
    ref = tmp_path / "ref.tiktoken"
    ref.write_bytes((shared_data / "tokenizer" / "gpt2.tiktoken").read_bytes())
    before = fingerprint(tokenize.Config(reference_vocab=str(ref)))
    ref.write_bytes(ref.read_bytes()[:-20])
    assert fingerprint(tokenize.Config(reference_vocab=str(ref))) != before


def test_output_does_not_depend_on_worker_order(stage_run, tmp_path):
    collect, config, out = stage_run.collect, stage_run.config, stage_run.out
    tokenize.run(config, tmp_path, engine=ReversedEngine(), collect=collect)
    for rel in OUTPUTS:
        assert (out / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel


@pytest.mark.slow
def test_ray_workers_write_the_same_shards(stage_run, tmp_path):
    from gristmill.infra.ray_engine import RayEngine

    collect, config, out = stage_run.collect, stage_run.config, stage_run.out
    engine = RayEngine(num_workers=2)
    try:
        tokenize.run(config, tmp_path, engine=engine, collect=collect)
    finally:
        engine.shutdown()
    for rel in OUTPUTS:
        assert (out / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel


def test_killed_run_redoes_only_unfinished_shards(stage_run, tmp_path, caplog):
    collect, config, result, out = stage_run.collect, stage_run.config, stage_run.result, stage_run.out
    with pytest.raises(KeyboardInterrupt):
        tokenize.run(config, tmp_path, engine=CrashingEngine(k=2), collect=collect)
    assert sorted(p.name for p in (tmp_path / "parts").glob("*.counts.json")) == ["00000.counts.json",
                                                                               "00001.counts.json"]
    engine = RecordingEngine()
    with caplog.at_level(logging.INFO, logger="gristmill.tokenize"):
        resumed = tokenize.run(config, tmp_path, engine=engine, collect=collect)
    assert [item["stem"] for item in engine.items] == ["00002"]
    assert "reusing the tokenizer" in caplog.text
    assert resumed.stats == result.stats
    for rel in OUTPUTS:
        assert (out / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel
