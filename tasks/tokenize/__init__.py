"""Stage 2, tokenize: train a byte-level BPE tokenizer (HF `tokenizers`) with the chat template's
special tokens, and encode the collected documents into uint16/uint32 token shards."""
from tasks.tokenize.stage import VERSION, Config, fingerprint, run

__all__ = ["Config", "VERSION", "fingerprint", "run"]
