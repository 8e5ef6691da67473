"""Aggregate metrics of benchmark results: accuracy with lm-eval's standard error, accuracy
centred on chance, the macro `core` score, perplexity, and the unbiased pass@k estimator.

Pure functions over numbers, so each is checked by hand in tests.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def mean_stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean as lm-eval computes it: sample standard deviation (n − 1)
    over √n; None for fewer than two values, where it is undefined."""
    n = len(values)
    if n < 2:
        return None
    mu = mean(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def centered(acc: float, chance: float) -> float:
    """Accuracy rescaled so chance is 0 and perfect is 1: (acc − chance) / (1 − chance)."""
    return (acc - chance) / (1 - chance)


def perplexity(logliks: Sequence[float]) -> float:
    """lm-eval's `perplexity` aggregation: exp of the mean negative log-likelihood per item."""
    return math.exp(-mean(logliks))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 − C(n−c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n samples, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def accuracy_block(correct: Sequence[float], prefix: str = "acc") -> dict[str, float | None]:
    """{prefix, prefix_stderr} of 0/1 outcomes."""
    return {prefix: mean(correct), f"{prefix}_stderr": mean_stderr(correct)}


def core_score(tasks: Mapping[str, Mapping[str, object]]) -> float | None:
    """Macro mean of `centered_acc` over the multiple-choice tasks (those that report one)."""
    values = [value for t in tasks.values() if isinstance(value := t.get("centered_acc"), float)]
    return mean(values) if values else None
