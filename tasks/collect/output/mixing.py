"""Data mixing: per-source weights and token budgets turn cleaned documents into the training mix.

A source's weight scales its tokens: 2.0 takes every document twice (two epochs of the source),
0.5 a seeded half of its tokens, 0 drops it. `token_budgets` caps a source, `total_tokens`
caps the whole mix by scaling every source's target by the same factor, so the weight ratios
survive. Documents are taken whole, so targets are met to within one document.

Selection is by tokens, not documents, because mixture weights are token shares (as in the
Dolma/OLMo and The Pile mixes): a source of few long documents must not be under-counted.
Tokens are estimated from UTF-8 bytes because the tokenizer is trained after this stage:
`bytes_per_token` defaults to 4.0, the usual figure for English with a ~50k BPE vocabulary
(GPT-2's on real web text: docs/benchmarks.md); a small vocabulary trained on less text
compresses worse, so 4.0 errs towards more tokens. Words would need a per-language factor;
bytes need one number.

Each source is sampled with its own random stream (seeded by `seed` and the source name), so
adding a source or changing another's weight leaves a source's own selection unchanged. The mix
is shuffled across sources with `seed`. `record` is the JSON that says what was taken.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Doc = Mapping[str, Any]  # a cleaned document: {"id", "text", "source", "url"}


class MixConfig(BaseModel):
    """How much of each source goes into the training mix."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    weights: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description="Per-source weight: multiplies the source's tokens (2.0 = every document "
                    "twice, 0.5 = a seeded half, 0 = none). Sources not named get 1.0.")
    token_budgets: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="Per-source cap on estimated tokens taken.")
    total_tokens: int | None = Field(
        default=None, ge=1, description="Cap on the whole mix in estimated tokens; every source's target "
                                        "is scaled by the same factor, keeping the weight ratios.")
    bytes_per_token: float = Field(default=4.0, gt=0, description="UTF-8 bytes per token used to "
                                                                  "estimate tokens before a tokenizer "
                                                                  "exists.")
    seed: int = Field(default=0, description="Seed of document sampling and of the mix order.")


def _source_rng(seed: int, source: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{source}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _doc_bytes(docs: Sequence[Doc], source: str) -> np.ndarray:
    sizes = []
    for i, doc in enumerate(docs):
        text = doc.get("text") if isinstance(doc, Mapping) else None
        if not isinstance(text, str):
            raise ValueError(f"source {source!r}, document {i}: no string field 'text'")
        sizes.append(len(text.encode("utf-8")))
    return np.array(sizes, dtype=np.int64)


def _take_bytes(sizes: np.ndarray, target_bytes: float, rng: np.random.Generator) -> np.ndarray:
    """Document indices, epoch after epoch (a fresh permutation each), until the target: a
    document is taken when that brings the total nearer the target than stopping would."""
    if target_bytes <= 0 or sizes.sum() == 0:
        return np.empty(0, dtype=np.int64)
    full_epochs = int(target_bytes // sizes.sum())
    taken = [rng.permutation(len(sizes)) for _ in range(full_epochs)]
    remaining = target_bytes - full_epochs * sizes.sum()
    order = rng.permutation(len(sizes))
    cumulative = np.cumsum(sizes[order])
    # stop before the first document whose midpoint lies past the target
    count = int(np.searchsorted(cumulative - sizes[order] / 2, remaining, side="right"))
    taken.append(order[:count])
    return np.concatenate(taken)


def _targets(sizes: Mapping[str, np.ndarray], cfg: MixConfig) -> dict[str, float]:
    """Target bytes per source: weight x available, per-source budget, then the total cap."""
    targets = {}
    for source, doc_sizes in sizes.items():
        target = cfg.weights.get(source, 1.0) * float(doc_sizes.sum())
        if source in cfg.token_budgets:
            target = min(target, cfg.token_budgets[source] * cfg.bytes_per_token)
        targets[source] = target
    total_bytes = sum(targets.values())
    if cfg.total_tokens is not None and total_bytes > cfg.total_tokens * cfg.bytes_per_token:
        scale = cfg.total_tokens * cfg.bytes_per_token / total_bytes
        targets = {source: target * scale for source, target in targets.items()}
    return targets


def mix_documents(docs_by_source: Mapping[str, Sequence[Doc]],
                  cfg: MixConfig) -> tuple[list[Doc], dict[str, Any]]:
    """The training mix (documents repeated when a source is upsampled, shuffled across sources)
    and its record: per source docs/tokens available, weight, budget, docs/tokens taken, epochs."""
    names, picks, record = mix_sizes({source: _doc_bytes(docs, source)
                                      for source, docs in docs_by_source.items()}, cfg)
    return [docs_by_source[names[s]][i] for s, i in picks.tolist()], record


def mix_sizes(sizes_by_source: Mapping[str, np.ndarray],
              cfg: MixConfig) -> tuple[list[str], np.ndarray, dict[str, Any]]:
    """`mix_documents` from the documents' UTF-8 sizes alone: the sources in sorted order, each
    document of the mix in mix order as a row (source's place in that order, index within the
    source) of an int64 array [docs, 2], and the record."""
    _check_sources(sizes_by_source, cfg)
    sizes = {source: np.asarray(doc_sizes, dtype=np.int64)
             for source, doc_sizes in sorted(sizes_by_source.items())}
    targets = _targets(sizes, cfg)
    picked: list[np.ndarray] = [np.zeros((0, 2), np.int64)]
    sources: dict[str, dict[str, Any]] = {}
    for s, (source, doc_sizes) in enumerate(sizes.items()):
        taken = _take_bytes(doc_sizes, targets[source], _source_rng(cfg.seed, source))
        picked.append(np.stack([np.full(len(taken), s, np.int64), taken.astype(np.int64)], axis=1))
        sources[source] = _source_record(doc_sizes, taken, targets[source], source, cfg)
    mixed = np.concatenate(picked)
    order = np.random.default_rng(cfg.seed).permutation(len(mixed))
    total = sum(s["tokens_taken"] for s in sources.values())
    for record in sources.values():
        record["share_of_mix"] = record["tokens_taken"] / total if total else 0.0
    record = {"bytes_per_token": cfg.bytes_per_token, "seed": cfg.seed,
              "total_tokens_cap": cfg.total_tokens, "docs": len(mixed), "tokens": total,
              "sources": sources}
    return list(sizes), mixed[order], record


def _check_sources(sources: Mapping[str, Any], cfg: MixConfig) -> None:
    unknown = sorted((set(cfg.weights) | set(cfg.token_budgets)) - set(sources))
    if unknown:
        raise ValueError(f"mix: weights/token_budgets name sources that do not exist: {unknown} "
                         f"(sources: {sorted(sources)})")


def _source_record(sizes: np.ndarray, picked: np.ndarray, target_bytes: float, source: str,
                   cfg: MixConfig) -> dict[str, Any]:
    def to_tokens(nbytes: float) -> int:
        return round(nbytes / cfg.bytes_per_token)

    available, taken = int(sizes.sum()), int(sizes[picked].sum())
    repeats = np.bincount(picked, minlength=len(sizes)) if len(sizes) else np.zeros(0, int)
    return {"docs_available": len(sizes), "tokens_available": to_tokens(available),
            "weight": cfg.weights.get(source, 1.0),
            "token_budget": cfg.token_budgets.get(source),
            "tokens_target": to_tokens(target_bytes),
            "docs_taken": len(picked), "tokens_taken": to_tokens(taken),
            "unique_docs_taken": int((repeats > 0).sum()),
            "epochs": taken / available if available else 0.0,
            "max_doc_repeats": int(repeats.max()) if len(repeats) else 0}
