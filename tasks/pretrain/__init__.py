"""Stage 3, pretrain: next-token prediction from scratch on the token shards, on the shared
training loop of `model.loop` (Accelerate: one CPU to many GPU processes)."""
from tasks.pretrain.stage import VERSION, Config, fingerprint, run

__all__ = ["Config", "VERSION", "fingerprint", "run"]
