"""Tokenize stage: train a byte-level BPE tokenizer on the collected documents and encode them.

Input: the collect stage's `docs/*.jsonl.gz`. Output (relative to out_dir):

    tokenizer/          HF tokenizer dir (tokenizer.json, config, chat template)
    tokens/train.bin    flat token ids, each document followed by `<|endoftext|>`
    tokens/val.bin      same, for the held-out documents
    tokens/meta.json    dtype, vocab size, token/document counts, UTF-8 bytes of the val text

Documents go to train or val by a hash of their id, so the split does not depend on input order
or random state. Encoding runs per input shard through `engine.map`; finished shards are kept in
`out_dir/parts/` until concatenated, so a killed run resumes without re-encoding them.

Run through the flow (`gristmill run ... tokenize`), or directly in tests with `SerialEngine`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Mapping

import numpy as np
from pydantic import Field, field_validator

from tasks.chat import CHAT_TEMPLATE, DOC_SEPARATOR, IM_END, PAD, SPECIAL_TOKENS
from tasks.stage import Engine, Manifest, StageConfig, StageResult, iter_jsonl

VERSION = 1
log = logging.getLogger("gristmill.tokenize")

UINT16_MAX_VOCAB = 2**16  # ids 0..65535 fit in uint16


class Config(StageConfig):
    """Tokenizer training and corpus encoding."""

    vocab_size: int = Field(4096, description="Target BPE vocabulary size, special tokens and the "
                                              "256 byte symbols included (may end smaller on a tiny corpus).")
    min_frequency: int = Field(2, description="Minimum pair count for a BPE merge.")
    max_train_bytes: int = Field(50_000_000, description="UTF-8 bytes of train-split text (first "
                                                          "documents in input order) used to train the tokenizer.")
    val_fraction: float = Field(0.05, description="Share of documents held out for validation, chosen "
                                                    "by a hash of the document id.")
    encode_batch_docs: int = Field(1000, description="Documents per encode_batch call (memory knob; "
                                                      "does not change outputs).")

    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"encode_batch_docs"})

    @field_validator("vocab_size")
    @classmethod
    def _vocab(cls, v: int) -> int:
        if not 256 + len(SPECIAL_TOKENS) < v <= 2**32:
            raise ValueError(f"vocab_size must exceed {256 + len(SPECIAL_TOKENS)} "
                             f"(bytes + special tokens), got {v}")
        return v

    @field_validator("min_frequency", "max_train_bytes", "encode_batch_docs")
    @classmethod
    def _positive(cls, v: int, info: Any) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("val_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 < v < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {v}")
        return v


# --- tokenizer ----------------------------------------------------------------------------------

def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Any:
    """Train a byte-level BPE and wrap it as a `PreTrainedTokenizerFast` carrying the chat template.

    The full byte alphabet is seeded so any text is encodable; nothing is added automatically on
    encode (documents get their separator explicitly, chat turns from the template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=DOC_SEPARATOR, eos_token=IM_END, pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Save as an HF tokenizer dir that `AutoTokenizer.from_pretrained` loads with its template."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))


# --- split and sampling -------------------------------------------------------------------------

def is_val(doc_id: str, val_fraction: float) -> bool:
    """Deterministic document-level split: the first 8 bytes of sha256(id) as a fraction of 2**64."""
    bucket = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return bucket / 2**64 < val_fraction


def doc_paths(collect_dir: Path) -> list[Path]:
    paths = sorted((Path(collect_dir) / "docs").glob("*.jsonl.gz"))
    if not paths:
        raise FileNotFoundError(f"no docs/*.jsonl.gz under collect output {collect_dir}")
    return paths


def train_sample(paths: list[Path], val_fraction: float, max_bytes: int) -> Iterator[str]:
    """Train-split texts in input order until `max_bytes` UTF-8 bytes have been yielded."""
    seen_bytes = 0
    for doc in iter_jsonl(paths):
        if is_val(doc["id"], val_fraction):
            continue
        yield doc["text"]
        seen_bytes += len(doc["text"].encode("utf-8"))
        if seen_bytes >= max_bytes:
            return


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


# --- encoding -----------------------------------------------------------------------------------

SPLITS = ("train", "val")


def _write_atomic(path: Path, ids: list[np.ndarray], dtype: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    (np.concatenate(ids) if ids else np.zeros(0)).astype(dtype).tofile(tmp)
    tmp.replace(path)


def encode_shard(job: dict[str, Any]) -> dict[str, int]:
    """Encode one input shard into `<parts>/<stem>.{train,val}.bin`; returns its counts.

    A top-level function of plain arguments so any engine can ship it to a worker."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(job["tokenizer_json"])
    sep_id = tok.token_to_id(DOC_SEPARATOR)
    ids: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    counts = {f"{s}_{k}": 0 for s in SPLITS for k in ("docs", "tokens", "bytes")}
    batch: list[dict[str, Any]] = []

    def flush() -> None:
        encodings = tok.encode_batch([d["text"] for d in batch], add_special_tokens=False)
        for doc, enc in zip(batch, encodings):
            split = "val" if is_val(doc["id"], job["val_fraction"]) else "train"
            ids[split].append(np.asarray(enc.ids + [sep_id], dtype=np.int64))
            counts[f"{split}_docs"] += 1
            counts[f"{split}_tokens"] += len(enc.ids) + 1
            counts[f"{split}_bytes"] += len(doc["text"].encode("utf-8"))
        batch.clear()

    for doc in iter_jsonl([Path(job["path"])]):
        batch.append(doc)
        if len(batch) >= job["batch_docs"]:
            flush()
    if batch:
        flush()
    parts = Path(job["parts_dir"])
    for split in SPLITS:
        _write_atomic(parts / f"{job['stem']}.{split}.bin", ids[split], job["dtype"])
    (parts / f"{job['stem']}.counts.json").write_text(json.dumps(counts, sort_keys=True))
    return counts


def _concat(parts: list[Path], out: Path) -> None:
    with out.open("wb") as dst:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, dst)


def _shard_jobs(paths: list[Path], tokenizer_json: Path, parts_dir: Path, config: Config,
                dtype: str) -> list[dict[str, Any]]:
    """One job per input shard, skipping shards a previous (killed) run already finished."""
    jobs = []
    for i, path in enumerate(paths):
        stem = f"{i:05d}"
        if (parts_dir / f"{stem}.counts.json").exists():
            continue
        jobs.append({"path": str(path), "stem": stem, "tokenizer_json": str(tokenizer_json),
                     "parts_dir": str(parts_dir), "val_fraction": config.val_fraction,
                     "batch_docs": config.encode_batch_docs, "dtype": dtype})
    return jobs


# --- stage --------------------------------------------------------------------------------------

def run(config: Config, inputs: Mapping[str, Manifest], out_dir: Path, *, engine: Engine) -> StageResult:
    out_dir = Path(out_dir)
    paths = doc_paths(inputs["collect"].path)
    tok_dir, tokens_dir, parts_dir = out_dir / "tokenizer", out_dir / "tokens", out_dir / "parts"
    tokens_dir.mkdir(parents=True, exist_ok=True)
    parts_dir.mkdir(parents=True, exist_ok=True)

    # Training is deterministic, so a resumed run retrains to the same tokenizer the kept
    # parts were encoded with.
    log.info("training BPE (vocab %d) on up to %d bytes from %d shards",
             config.vocab_size, config.max_train_bytes, len(paths))
    tokenizer = train_tokenizer(train_sample(paths, config.val_fraction, config.max_train_bytes),
                                config.vocab_size, config.min_frequency)
    save_tokenizer(tokenizer, tok_dir)
    vocab_size = len(tokenizer)
    dtype = token_dtype(vocab_size)

    jobs = _shard_jobs(paths, tok_dir / "tokenizer.json", parts_dir, config, dtype)
    log.info("encoding %d shards (%d already done)", len(jobs), len(paths) - len(jobs))
    engine.map(encode_shard, jobs)

    stems = [f"{i:05d}" for i in range(len(paths))]
    totals = {k: 0 for k in json.loads((parts_dir / f"{stems[0]}.counts.json").read_text())}
    for stem in stems:
        for k, v in json.loads((parts_dir / f"{stem}.counts.json").read_text()).items():
            totals[k] += v
    for split in SPLITS:
        _concat([parts_dir / f"{s}.{split}.bin" for s in stems], tokens_dir / f"{split}.bin")
    shutil.rmtree(parts_dir)

    if totals["val_docs"] == 0 or totals["train_docs"] == 0:
        raise ValueError(f"val_fraction={config.val_fraction} left a split empty "
                         f"({totals['train_docs']} train / {totals['val_docs']} val docs)")
    meta = {"dtype": dtype, "vocab_size": vocab_size,
            "train_tokens": totals["train_tokens"], "val_tokens": totals["val_tokens"],
            "train_docs": totals["train_docs"], "val_docs": totals["val_docs"],
            "val_bytes": totals["val_bytes"]}
    (tokens_dir / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    # Separator tokens count as tokens but cover no bytes; the evaluation's bits per byte uses
    # the same convention, so the two numbers stay comparable.
    stats = {**{k: v for k, v in meta.items() if k != "dtype" and k != "val_bytes"},
             "bytes_per_token": totals["val_bytes"] / totals["val_tokens"]}
    log.info("tokenized: %s", stats)
    return StageResult(stats=stats, artifacts=["tokens/meta.json"])
