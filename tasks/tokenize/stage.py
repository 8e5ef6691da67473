"""Tokenize stage: train a byte-level BPE tokenizer on the collected documents and encode them.

Input: the collect stage's `docs/*.jsonl.gz`. Output (relative to out_dir):

    tokenizer/          HF tokenizer dir (tokenizer.json, config, chat template)
    tokens/train.bin    flat token ids, each document followed by `<|endoftext|>`
    tokens/val.bin      same, for the held-out documents
    tokens/meta.json    dtype, vocab size, token/document counts, UTF-8 bytes of the val text
    tokens/index.json   per input shard: its token offset, token and document counts in each .bin

Documents go to train or val by a hash of their id, so the split does not depend on input order,
worker count or random state. Encoding runs per input shard through `engine.map`; each finished
shard is kept in `out_dir/parts/` (and the trained tokenizer in `out_dir/tokenizer/`) until the
parts are concatenated in input order, so a killed run resumes by encoding only unfinished shards.
With the artifact store on a bucket, workers read their shard, the tokenizer and write their
parts there instead (core.stage.worker_dir), so Ray's nodes share no disk.

Compression (UTF-8 bytes per token of the val text) is reported next to a reference vocabulary
(a tiktoken rank file such as GPT-2's) measured on the same text.

Run through the flow (`gristmill run ... tokenize`), or directly in tests with `SerialEngine`.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
import logging
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gristmill.core.chat import CHAT_TEMPLATE, DOC_SEPARATOR, IM_END, PAD, SPECIAL_TOKENS
from gristmill.core.files import (
    ensure_free_space,
    is_url,
    iter_jsonl,
    names_in,
    open_location,
    publish_file,
    remove_tree,
)
from gristmill.core.sources import file_size
from gristmill.core.stage import Engine, Manifest, StageResult, worker_dir
from gristmill.tasks.tokenize.config import Config

log = logging.getLogger("gristmill.tokenize")

UINT16_MAX_VOCAB = 2**16  # ids 0..65535 fit in uint16

# cl100k (GPT-4) pre-tokenization: contractions, letter runs with one leading non-letter, numbers in
# groups of at most {digits} digits, punctuation runs, newlines, other whitespace. `{digits}` is
# filled from the config (cl100k itself uses 3).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,{digits}}}"
                 r"| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-2's pattern, used with GPT-2's rank file for the reference measurement.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# --- tokenizer ----------------------------------------------------------------------------------

def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    max_digits_per_token: int = 1) -> Any:
    """Train a byte-level BPE and wrap it as a `PreTrainedTokenizerFast` carrying the chat template.

    Text is split by the GPT-4 pattern first, then mapped to bytes without a second regex. The
    256-byte alphabet is seeded, so any string is encodable (byte fallback by construction) and
    decoding is lossless. Nothing is added automatically on encode (documents get their separator
    explicitly, chat turns from the template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN.format(digits=max_digits_per_token)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
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


def load_reference(path: str | Path) -> Any:
    """A tiktoken `Encoding` built offline from a rank file (`base64(token) rank` per line) and
    GPT-2's split pattern; `<|endoftext|>` takes the id after the last rank, as in GPT-2."""
    import tiktoken

    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in Path(path).read_text().splitlines() if line)}
    return tiktoken.Encoding(Path(path).stem, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={DOC_SEPARATOR: len(ranks)})


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


def _batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


def pack_documents(id_lists: list[list[int]], sep_id: int, dtype: str) -> np.ndarray:
    """Documents' ids concatenated into one flat array, each followed by the separator."""
    n_tokens = sum(len(ids) for ids in id_lists) + len(id_lists)
    flat = itertools.chain.from_iterable((*ids, sep_id) for ids in id_lists)
    return np.fromiter(flat, dtype=dtype, count=n_tokens)


def open_encoder(tokenizer_json: str | Path) -> Any:
    """The raw `tokenizers.Tokenizer` the stage encodes documents with (a path or URL), one per
    worker process and file version: its word cache stays warm across the shards a worker encodes."""
    if is_url(tokenizer_json):
        from gristmill.core import object_store

        return _cached_encoder(str(tokenizer_json), object_store.version_of(str(tokenizer_json)), 0)
    stat = Path(tokenizer_json).stat()
    return _cached_encoder(str(tokenizer_json), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_encoder(tokenizer_json: str, version: int | str, size: int) -> Any:
    from tokenizers import Tokenizer

    with open_location(tokenizer_json) as f:
        tok = Tokenizer.from_str(f.read().decode("utf-8"))
    # A literal "<|endoftext|>" inside crawled text must stay text, not fake a document boundary.
    tok.encode_special_tokens = True
    return tok


def encode_shard(job: dict[str, Any]) -> dict[str, int]:
    """Encode one input shard into `<parts>/<stem>.{train,val}.bin`; returns its counts.

    A top-level function of plain arguments so any engine can ship it to a worker. The counts
    file is written last: its presence marks the shard finished."""
    tok = open_encoder(job["tokenizer_json"])
    sep_id = tok.token_to_id(DOC_SEPARATOR)
    reference = load_reference(job["reference_vocab"]) if job["reference_vocab"] else None
    counts = {f"{s}_{k}": 0 for s in SPLITS for k in ("docs", "tokens", "bytes")}
    counts["val_reference_tokens"] = 0
    parts = job["parts_dir"]
    scratch = Path(tempfile.mkdtemp(prefix="tokenize-")) if is_url(parts) else Path(parts)  # written here first
    # Token ids take about as many bytes as the text (2-4 bytes per 3-4 characters): the input's
    # size, times the compression of a .gz input, bounds the shard.
    text_bytes = file_size(job["path"]) * (4 if str(job["path"]).endswith(".gz") else 1)
    ensure_free_space(scratch, text_bytes, "a token shard")
    tmp = {s: scratch / f"{job['stem']}.{s}.bin.tmp" for s in SPLITS}
    files = {s: tmp[s].open("wb") for s in SPLITS}

    def write(batch: list[dict[str, Any]], encodings: list[Any]) -> None:
        by_split: dict[str, tuple[list[str], list[list[int]]]] = {s: ([], []) for s in SPLITS}
        for doc, enc in zip(batch, encodings):
            split = "val" if is_val(doc["id"], job["val_fraction"]) else "train"
            by_split[split][0].append(doc["text"])
            by_split[split][1].append(enc.ids)
        for split, (texts, id_lists) in by_split.items():
            files[split].write(pack_documents(id_lists, sep_id, job["dtype"]).tobytes())
            counts[f"{split}_docs"] += len(texts)
            counts[f"{split}_tokens"] += sum(map(len, id_lists)) + len(id_lists)
            counts[f"{split}_bytes"] += sum(len(t.encode("utf-8")) for t in texts)
        if reference is not None and by_split["val"][0]:
            counts["val_reference_tokens"] += sum(map(len, reference.encode_ordinary_batch(by_split["val"][0])))

    # encode_batch releases the GIL: reading and writing neighbouring batches overlaps with it.
    # The _fast variant gives the same ids without tracking character offsets, which the shards
    # do not keep (~20% less tokenizer CPU, see bench/tokenize.py).
    pending: tuple[list[dict[str, Any]], Future] | None = None
    with ThreadPoolExecutor(1) as pool:
        try:
            for batch in _batches(iter_jsonl([job["path"]]), job["batch_docs"]):
                future = pool.submit(tok.encode_batch_fast, [d["text"] for d in batch],
                                     add_special_tokens=False)
                if pending:
                    write(pending[0], pending[1].result())
                pending = (batch, future)
            if pending:
                write(pending[0], pending[1].result())
        finally:
            for f in files.values():
                f.close()
    for split in SPLITS:
        publish_file(tmp[split], f"{parts}/{job['stem']}.{split}.bin")
    counts_file = scratch / f"{job['stem']}.counts.json.tmp"
    counts_file.write_text(json.dumps(counts, sort_keys=True))
    publish_file(counts_file, f"{parts}/{job['stem']}.counts.json")  # last: the shard is finished
    if scratch != Path(parts):
        shutil.rmtree(scratch)
    return counts


def _concat(parts: list[str], out: Path) -> None:
    ensure_free_space(out.parent, sum(file_size(p) for p in parts), f"{out.name}")
    with out.open("wb") as dst:
        for part in parts:
            with open_location(part) as src:
                shutil.copyfileobj(src, dst)


def _shard_jobs(paths: list[str], tokenizer_json: str, parts_dir: str, config: Config,
                dtype: str) -> list[dict[str, Any]]:
    """One job per input shard, skipping shards a previous (killed) run already finished."""
    jobs = []
    done = names_in(str(parts_dir))
    for i, path in enumerate(paths):
        stem = f"{i:05d}"
        if f"{stem}.counts.json" in done:
            continue
        jobs.append({"path": str(path), "stem": stem, "tokenizer_json": str(tokenizer_json),
                     "parts_dir": str(parts_dir), "val_fraction": config.val_fraction,
                     "batch_docs": config.encode_batch_docs, "dtype": dtype,
                     "reference_vocab": config.reference_vocab})
    return jobs


def _tokenizer_dir(config: Config, paths: list[Path], out_dir: Path) -> Path:
    """Train and save the tokenizer, or reuse the one a killed run saved (the kept parts were
    encoded with it). Saved under a temporary name and renamed, so a present dir is complete."""
    tok_dir = out_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        log.info("reusing the tokenizer trained by a previous run")
        return tok_dir
    log.info("training BPE (vocab %d) on up to %d bytes from %d shards",
             config.vocab_size, config.max_train_bytes, len(paths))
    tokenizer = train_tokenizer(train_sample(paths, config.val_fraction, config.max_train_bytes),
                                config.vocab_size, config.min_frequency, config.max_digits_per_token)
    tmp = out_dir / "tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_tokenizer(tokenizer, tmp)
    tmp.replace(tok_dir)
    return tok_dir


def _index(paths: list[Path], shard_counts: list[dict[str, int]], dtype: str) -> dict[str, Any]:
    """Where each input shard's documents sit in train.bin / val.bin (offsets in tokens)."""
    offsets = {s: 0 for s in SPLITS}
    shards = []
    for path, counts in zip(paths, shard_counts):
        entry: dict[str, Any] = {"input": path.name}
        for split in SPLITS:
            entry[split] = {"offset": offsets[split], "tokens": counts[f"{split}_tokens"],
                            "docs": counts[f"{split}_docs"]}
            offsets[split] += counts[f"{split}_tokens"]
        shards.append(entry)
    return {"dtype": dtype, "shards": shards}


def _compression_stats(totals: dict[str, int], with_reference: bool) -> dict[str, float]:
    """UTF-8 bytes per token of the val text, separators excluded (they cover no text); >1 in
    `compression_vs_reference` means fewer tokens than the reference vocabulary on the same text."""
    ours = totals["val_bytes"] / (totals["val_tokens"] - totals["val_docs"])
    stats = {"bytes_per_token": ours}
    if with_reference:
        reference = totals["val_bytes"] / totals["val_reference_tokens"]
        stats |= {"reference_bytes_per_token": reference, "compression_vs_reference": ours / reference}
    return stats


# --- stage --------------------------------------------------------------------------------------

def run(config: Config, out_dir: Path, *, engine: Engine, collect: Manifest) -> StageResult:
    from tokenizers import Tokenizer

    out_dir = Path(out_dir)
    paths = doc_paths(collect.path)
    tokens_dir, parts_dir = out_dir / "tokens", out_dir / "parts"
    tokens_dir.mkdir(parents=True, exist_ok=True)
    parts_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = _tokenizer_dir(config, paths, out_dir)
    vocab_size = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)

    # where the workers read and write: these folders, or their places on the store's bucket
    parts_at, tokenizer_at = worker_dir(engine, parts_dir), worker_dir(engine, tok_dir / "tokenizer.json")
    if is_url(tokenizer_at):  # the tokenizer this run commits, for the workers
        shutil.copyfile(tok_dir / "tokenizer.json", out_dir / "tokenizer.json.tmp")
        publish_file(out_dir / "tokenizer.json.tmp", tokenizer_at)
    jobs = _shard_jobs([worker_dir(engine, p) for p in paths], tokenizer_at, parts_at, config, dtype)
    log.info("encoding %d shards (%d already done)", len(jobs), len(paths) - len(jobs))
    engine.map(encode_shard, jobs)

    stems = [f"{i:05d}" for i in range(len(paths))]
    shard_counts = []
    for stem in stems:
        with open_location(f"{parts_at}/{stem}.counts.json") as f:
            shard_counts.append(json.loads(f.read()))
    totals = {k: sum(c[k] for c in shard_counts) for k in shard_counts[0]}
    if totals["val_docs"] == 0 or totals["train_docs"] == 0:
        raise ValueError(f"val_fraction={config.val_fraction} left a split empty "
                         f"({totals['train_docs']} train / {totals['val_docs']} val docs)")
    for split in SPLITS:
        _concat([f"{parts_at}/{s}.{split}.bin" for s in stems], tokens_dir / f"{split}.bin")
    (tokens_dir / "index.json").write_text(json.dumps(_index(paths, shard_counts, dtype), indent=1) + "\n")
    meta = {"dtype": dtype, "vocab_size": vocab_size,
            "train_tokens": totals["train_tokens"], "val_tokens": totals["val_tokens"],
            "train_docs": totals["train_docs"], "val_docs": totals["val_docs"],
            "val_bytes": totals["val_bytes"]}
    (tokens_dir / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(parts_dir)
    if is_url(parts_at):  # the encoded parts and the tokenizer's copy on the bucket
        remove_tree(parts_at)
        remove_tree(tokenizer_at.rsplit("/", 1)[0])

    stats = {**{k: v for k, v in meta.items() if k not in ("dtype", "val_bytes")},
             **_compression_stats(totals, config.reference_vocab is not None)}
    log.info("tokenized: %s", stats)
    return StageResult(stats=stats, artifacts=["tokens/meta.json", "tokens/index.json"])
