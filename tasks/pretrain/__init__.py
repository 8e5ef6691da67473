"""Stage 3, pretrain: next-token prediction from scratch on the token shards, on the shared
training loop of `gristmill.model.loop` (Accelerate: one CPU to many GPU processes).

`config` holds the stage's `Config`, `VERSION` and `fingerprint` (light, so planning a run
stays fast); `stage` its `run`, imported only when the stage computes. The stage's entry in
flows/stages.py names both."""
