"""Stage 4, SFT: chat-template fine-tuning with the loss on assistant tokens only, optional LoRA
and packing. `conversations` reads the supported conversation formats.

`config` holds the stage's `Config`, `VERSION` and `fingerprint` (light, so planning a run
stays fast); `stage` its `run`, imported only when the stage computes. The stage's entry in
flows/stages.py names both."""
