"""Unit conversions of language-model losses, defined once."""
from __future__ import annotations

import math


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """A mean next-token loss (nats per token) in bits per UTF-8 byte of the text scored, which
    compares across tokenizers. `bytes_per_token`: the scored text's bytes over its tokens."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    return nats_per_token / (math.log(2) * bytes_per_token)
