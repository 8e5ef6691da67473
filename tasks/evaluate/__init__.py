"""Stage 6, evaluate: perplexity, bits per byte, held-out arithmetic, and multiple-choice files for
every model of the run; the report card compares base → SFT → aligned."""
from tasks.evaluate.stage import VERSION, Config, fingerprint, run

__all__ = ["Config", "VERSION", "fingerprint", "run"]
