"""Stage 2, tokenize: train a byte-level BPE tokenizer (HF `tokenizers`) with the chat template's
special tokens, and encode the collected documents into uint16/uint32 token shards.

`config` holds the stage's `Config`, `VERSION` and `fingerprint` (light, so planning a run
stays fast); `stage` its `run`, imported only when the stage computes. The stage's entry in
flows/stages.py names both."""
