"""Tokenize-to-shards throughput against its ceiling and against datatrove.

    python -m bench tokenize [--corpus DIR_OR_FILE] [--mb 20] [--threads 2] [--repeats 3] [--smoke]

Builds ~`--mb` MB of documents from real text (default: every file of ../shared/data/corpus, split
into paragraphs-sized documents and repeated), trains the stage's tokenizer on it once, writes
the documents as a collect output (`docs/part-*.jsonl.gz`), then times, on the same documents
with the same tokenizer and the same number of tokenizer threads:

  raw         `Tokenizer.encode_batch` on in-memory texts, ids extracted (nothing but
              tokenization)
  raw_fast    the same with `encode_batch_fast` (no character offsets, the same ids): the
              ceiling of the stage, which encodes this way
  stage       the stage's path: read the shards, encode (`encode_shard` via SerialEngine), write
              uint16 parts, concatenate into train.bin / val.bin
  datatrove   JsonlReader -> DocumentTokenizer (no shuffling) on LocalPipelineExecutor(1 task)

Each repeat times every method once, in turn, so a change in the machine's load hits all of
them alike. MB/s are UTF-8 MB of document text per second, medians over `--repeats`. The last
line is one JSON object with the figures, `ratio_vs_raw`, `ratio_vs_raw_fast` and
`ratio_vs_datatrove`.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import smoke
from bench.harness.runs import SHARED_DATA

DOC_CHARS = 4000  # documents of about a web page's length
SHARDS = 4
BATCH_DOCS = 256  # documents per encode_batch call, every method (about 1 MB)


def _read(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def build_docs(corpus: Path, target_bytes: int) -> list[str]:
    """Paragraph-aligned chunks of about DOC_CHARS characters from every text file, repeated
    until `target_bytes` UTF-8 bytes."""
    files = sorted(p for p in corpus.rglob("*") if p.is_file()) if corpus.is_dir() else [corpus]
    chunks = []
    for text in map(_read, files):
        start = 0
        while start < len(text):
            end = text.find("\n", start + DOC_CHARS)
            end = len(text) if end < 0 else end + 1
            chunks.append(text[start:end])
            start = end
    docs, size = [], 0
    while size < target_bytes:
        for chunk in chunks:
            docs.append(chunk)
            size += len(chunk.encode("utf-8"))
            if size >= target_bytes:
                break
    return docs


def write_collect(docs: list[str], root: Path) -> list[Path]:
    (root / "docs").mkdir(parents=True)
    paths = [root / "docs" / f"part-{i:05d}.jsonl.gz" for i in range(SHARDS)]
    for i, path in enumerate(paths):
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
            for j in range(i, len(docs), SHARDS):
                f.write(json.dumps({"id": f"doc-{j}", "text": docs[j], "source": "bench", "url": ""}) + "\n")
    return paths


def time_raw(tokenizer_json: Path, docs: list[str], method: str = "encode_batch") -> None:
    from gristmill.tasks.tokenize.stage import open_encoder

    encode = getattr(open_encoder(tokenizer_json), method)
    for i in range(0, len(docs), BATCH_DOCS):
        [e.ids for e in encode(docs[i : i + BATCH_DOCS], add_special_tokens=False)]


def time_stage(tokenizer_json: Path, collect_paths: list[Path], work: Path) -> None:
    import gristmill.tasks.tokenize.stage as tokenize
    from gristmill.core.stage import SerialEngine

    config = tokenize.Config(encode_batch_docs=BATCH_DOCS, val_fraction=0.05)
    parts, tokens = work / "parts", work / "tokens"
    parts.mkdir(parents=True)
    tokens.mkdir()
    SerialEngine().map(tokenize.encode_shard,
                       tokenize._shard_jobs(collect_paths, tokenizer_json, parts, config, "uint16"))
    for split in tokenize.SPLITS:
        tokenize._concat([parts / f"{i:05d}.{split}.bin" for i in range(len(collect_paths))],
                         tokens / f"{split}.bin")


def time_datatrove(tokenizer_json: Path, collect_dir: Path, work: Path) -> None:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    pipeline = [JsonlReader(str(collect_dir / "docs"), glob_pattern="*.jsonl.gz"),
                DocumentTokenizer(str(work / "out"), tokenizer_name_or_path=str(tokenizer_json),
                                  eos_token="<|endoftext|>", batch_size=BATCH_DOCS,
                                  shuffle_documents=False, save_final_metadata=False)]
    LocalPipelineExecutor(pipeline, tasks=1, workers=1, logging_dir=str(work / "logs"),
                          skip_completed=False).run()


def median_seconds(methods: dict[str, Callable[[Path], None]], scratch: Path,
                   repeats: int) -> dict[str, float]:
    """Median seconds of each method; every repeat runs all methods once, in turn."""
    from gristmill.tasks.tokenize.stage import _cached_encoder

    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(repeats):
        for name, fn in methods.items():
            work = scratch / f"run-{name}-{r}"
            _cached_encoder.cache_clear()  # every method starts with a cold tokenizer, as datatrove does
            start = time.perf_counter()
            fn(work)
            times[name].append(time.perf_counter() - start)
            shutil.rmtree(work, ignore_errors=True)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench tokenize", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=SHARED_DATA / "corpus")
    parser.add_argument("--mb", type=float, default=20.0, help="MB of document text to tokenize")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="tokenizer threads (all methods)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = smoke.parse(parser, argv, mb=0.2, threads=1, vocab_size=512, repeats=1)
    # Read by the tokenizers library when it first runs in parallel: set before any encoding.
    os.environ.update(TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS=str(args.threads))
    from gristmill.tasks.tokenize.stage import save_tokenizer, train_tokenizer

    docs = build_docs(args.corpus, int(args.mb * 1e6))
    text_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        root = Path(tmp)
        save_tokenizer(train_tokenizer(docs[: max(1, len(docs) // 4)], args.vocab_size), root / "tokenizer")
        tokenizer_json = root / "tokenizer" / "tokenizer.json"
        collect_paths = write_collect(docs, root / "collect")
        seconds = median_seconds({
            "raw": lambda w: time_raw(tokenizer_json, docs),
            "raw_fast": lambda w: time_raw(tokenizer_json, docs, "encode_batch_fast"),
            "stage": lambda w: time_stage(tokenizer_json, collect_paths, w),
            "datatrove": lambda w: time_datatrove(tokenizer_json, root / "collect", w),
        }, root, args.repeats)
    mb_s = {name: text_mb / s for name, s in seconds.items()}
    print(f"{len(docs)} docs, {text_mb:.1f} MB, {args.threads} tokenizer threads, "
          f"vocab {args.vocab_size}, median of {args.repeats}")
    print(f"{'method':<12}{'seconds':>10}{'MB/s':>10}")
    for name in seconds:
        print(f"{name:<12}{seconds[name]:>10.2f}{mb_s[name]:>10.2f}")
    print(json.dumps({"bench": "tokenize", "text_mb": round(text_mb, 2), "threads": args.threads,
                      **{f"{k}_mb_s": round(v, 3) for k, v in mb_s.items()},
                      "ratio_vs_raw": round(mb_s["stage"] / mb_s["raw"], 3),
                      "ratio_vs_raw_fast": round(mb_s["stage"] / mb_s["raw_fast"], 3),
                      "ratio_vs_datatrove": round(mb_s["stage"] / mb_s["datatrove"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
