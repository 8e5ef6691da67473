"""General-purpose compressors as the baseline a language model's bits per byte must beat.

A model trained on a corpus should predict its held-out text better than xz or zstd do, and
better still than they do after reading the same training text. So, on exactly the bytes
`val_bpb` is measured on: xz (`-9e`, Python's liblzma) and zstd (level 22), each alone and given
the training text (the size of compress(train + val) minus compress(train), the conditional
code length). The training text is the first `compression_train_mb` MiB of the decoded train
split: xz's window at -9 is 64 MiB and zstd's at level 22 is 128 MiB, so text further back cannot
help them.
"""
from __future__ import annotations

import lzma
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode


def xz(data: bytes) -> int:
    return len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))


def zstd(data: bytes) -> int:
    import zstandard  # here: scoring a model (the GPU check, on a bare image) needs no compressor

    return len(zstandard.ZstdCompressor(level=22).compress(data))


COMPRESSORS: dict[str, Callable[[bytes], int]] = {"xz": xz, "zstd": zstd}


@cache
def _byte_of_symbol() -> dict[str, int]:
    """Byte-level BPE spells every byte as one printable character; this inverts that."""
    return {symbol: byte for byte, symbol in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, ids: Iterable[int]) -> bytes:
    """The exact UTF-8 bytes a run of byte-level BPE token ids stands for; special tokens (document
    separators, chat markers) stand for no text. Decoding to `str` could not split a character
    between two runs of tokens: this can."""
    special = set(tokenizer.all_special_ids)
    byte_of = _byte_of_symbol()
    pieces = tokenizer.convert_ids_to_tokens([int(i) for i in ids if int(i) not in special])
    return bytes(byte_of[symbol] for piece in pieces for symbol in piece)


def bits_per_byte(size: int, n_bytes: int) -> float:
    return 8 * size / n_bytes


def baselines(scored: bytes, train: bytes) -> dict[str, float]:
    """`<compressor>_bpb` (the scored bytes alone) and `<compressor>_given_train_bpb` for each of
    COMPRESSORS, and the bytes each figure covers."""
    if not scored:
        raise ValueError("no bytes to compress")
    result: dict[str, float] = {"scored_bytes": len(scored), "train_bytes": len(train)}
    for name, size in COMPRESSORS.items():
        result[f"{name}_bpb"] = bits_per_byte(size(scored), len(scored))
        if train:
            result[f"{name}_given_train_bpb"] = bits_per_byte(size(train + scored) - size(train), len(scored))
    return result


def train_text(tokenizer: Any, train_tokens: np.ndarray, cap_bytes: int) -> bytes:
    """The first `cap_bytes` of the decoded train split, decoded in chunks so a large split is
    never decoded whole."""
    chunks, total, chunk_tokens = [], 0, 1 << 20
    for start in range(0, len(train_tokens), chunk_tokens):
        if total >= cap_bytes:
            break
        chunks.append(token_bytes(tokenizer, train_tokens[start : start + chunk_tokens]))
        total += len(chunks[-1])
    return b"".join(chunks)[:cap_bytes]
