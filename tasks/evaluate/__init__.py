"""Stage 6, evaluate: perplexity, bits per byte, held-out arithmetic, and multiple-choice files for
every model of the run; the report card compares base → SFT → aligned.

`config` holds the stage's `Config`, `VERSION` and `fingerprint` (light, so planning a run
stays fast); `stage` its `run`, imported only when the stage computes. The stage's entry in
flows/stages.py names both."""
