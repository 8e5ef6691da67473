"""What several training tests share: a tiny model config, token shards written as the tokenize
stage writes them, and the tokenize output the data-parallel tests train on."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from gristmill.core.chat import DOC_SEPARATOR

MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "max_seq_len": 64}


def write_tokens(tokenizer, docs: dict[str, list[str]], out: Path) -> None:
    """A tokenize-stage output: each document's ids followed by <|endoftext|>, uint16 shards."""
    sep = tokenizer.convert_tokens_to_ids(DOC_SEPARATOR)
    out.mkdir(parents=True)
    meta = {"dtype": "uint16", "vocab_size": len(tokenizer)}
    for split, texts in docs.items():
        ids = [i for text in texts for i in [*tokenizer(text).input_ids, sep]]
        np.asarray(ids, dtype=np.uint16).tofile(out / f"{split}.bin")
        meta.update({f"{split}_tokens": len(ids), f"{split}_docs": len(texts)})
    meta["val_bytes"] = sum(len(t.encode()) for t in docs["val"])
    (out / "meta.json").write_text(json.dumps(meta))


def pretrain_config(**overrides):
    """The pretrain stage's config for the tiny model: 30 steps, a checkpoint and an eval every 10."""
    from gristmill.tasks.pretrain.config import Config

    return Config(**{"model": MODEL, "seq_len": 32, "batch_size": 8, "max_steps": 30, "lr": 3e-3,
                     "warmup_frac": 0.1, "val_windows": 8, "checkpoint_every": 10,
                     "eval_every": 10, "device": "cpu", **overrides})


def untimed(rows: list[dict]) -> list[dict]:
    """Metric rows without their wall-clock figures, which differ between two identical runs."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "checkpoint_s")} for r in rows]


REPO = Path(__file__).resolve().parents[1]


CONFIG = {"model": MODEL, "seq_len": 32, "batch_size": 8, "max_steps": 6, "lr": 3e-3, "val_windows": 8,
          "checkpoint_every": 3, "eval_every": 3, "log_every": 3, "device": "cpu"}


@pytest.fixture(scope="module")
def tokenize_dir(tmp_path_factory, tiny_tokenizer_dir, shared_data) -> Path:
    root = tmp_path_factory.mktemp("tokenize")
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.save_pretrained(root / "tokenizer")
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[:200_000]
    docs = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    write_tokens(tokenizer, {"train": docs[:-5], "val": docs[-5:]}, root / "tokens")
    return root
