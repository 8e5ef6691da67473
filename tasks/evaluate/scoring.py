"""Log-likelihood of continuations given contexts, tokenized exactly as lm-evaluation-harness's
HFLM does, batched.

lm-eval's `_encode_pair` moves the context's trailing spaces onto the continuation, encodes
context+continuation whole and takes the tokens past the encoded context as the continuation,
so a byte-level BPE sees " Paris" as it would in running text. `tok_encode` adds the tokenizer's
special tokens (its own default) unless the text already starts with the prefix (BOS) token.
Matching this token for token is what makes our per-item numbers equal lm-eval's.

An item's requests share one forward pass: their common token prefix (the context) is fed once
and each continuation after it, with position ids continuing from the prefix and a 4D attention
mask letting each continuation see only the prefix and itself (`Packed`). Items are sorted
longest first and right-padded into batches (padding after a sequence changes none of its
logits). lm-eval runs each (context, continuation) pair in full, one per forward by default.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_LENGTH = 2048  # lm-eval's fallback when neither config nor tokenizer gives a length
TOKENIZER_INFINITY = 1_000_000_000_000  # transformers' "no model_max_length" is 1e30; anything this big


def max_length(model_config: Any, tokenizer: Any) -> int:
    """The model's context length as lm-eval resolves it: config attribute, tokenizer, default."""
    config = getattr(model_config, "text_config", None) or model_config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < TOKENIZER_INFINITY else DEFAULT_MAX_LENGTH


class LoglikScorer:
    """Summed continuation log-probabilities (nats) and whether greedy decoding would produce
    the continuation, for (context, continuation) pairs."""

    def __init__(self, model: Any, tokenizer: Any, device: str, batch_size: int = 16) -> None:
        self.model, self.tokenizer, self.device, self.batch_size = model, tokenizer, device, batch_size
        self.max_length = max_length(model.config, tokenizer)
        bos = tokenizer.bos_token_id
        self.prefix_token_id = bos if bos is not None else tokenizer.eos_token_id
        self._prefix_text = tokenizer.decode(self.prefix_token_id) if self.prefix_token_id is not None else None

    def tok_encode(self, text: str) -> list[int]:
        if self._prefix_text and text.startswith(self._prefix_text):
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:  # lm-eval: the prefix (BOS/EOS) token stands in for an empty context
            cont = self.tokenizer.encode(continuation, add_special_tokens=False)
            return ([self.prefix_token_id], cont) if cont[:1] != [self.prefix_token_id] else (cont[:1], cont[1:])
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        return ctx, whole[len(ctx):]

    def loglikelihoods(self, requests: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) per request, in the order given."""
        return [scores[0] for scores in self.score_groups([[r] for r in requests])]

    def score_groups(self, groups: Sequence[Sequence[tuple[str, str]]]) -> list[list[tuple[float, bool]]]:
        """(log-likelihood, is_greedy) per request of each group (one benchmark item's choices)."""
        packed = [_pack([self._request(c, x) for c, x in group]) for group in groups]
        order = sorted(range(len(packed)), key=lambda i: -len(packed[i].tokens))
        results: list[list[tuple[float, bool]]] = [[] for _ in packed]
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, scores in zip(batch, self._forward([packed[i] for i in batch])):
                results[i] = scores
        return results

    def _request(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(model input, continuation tokens): lm-eval keeps the last max_length+1 tokens of
        context+continuation and feeds all but the last."""
        ctx, cont = self.encode_pair(context, continuation)
        return (ctx + cont)[-(self.max_length + 1):][:-1], cont

    def _forward(self, rows: list[Packed]) -> list[list[tuple[float, bool]]]:
        import torch

        width = max(len(r.tokens) for r in rows)

        def pad(values: list[list[int]], fill: int) -> list[list[int]]:
            return [v + [fill] * (width - len(v)) for v in values]

        ids = torch.tensor(pad([r.tokens for r in rows], 0), device=self.device)
        positions = torch.tensor(pad([r.positions for r in rows], 0), device=self.device)
        segments = torch.tensor(pad([r.segments for r in rows], -1), device=self.device)
        shared = {"position_ids": positions,  # rows of one request need neither: plain causal attention
                  "attention_mask": _attention_bias(segments, next(self.model.parameters()).dtype)}
        with torch.no_grad():
            logits = self.model(input_ids=ids, **(shared if segments.max() > 0 else {})).logits
        out = []
        for row, packed in enumerate(rows):
            scores = []
            for where, cont in packed.targets:
                logprobs = logits[row, where].float().log_softmax(-1)
                target = torch.tensor(cont, device=self.device)
                scores.append((logprobs.gather(-1, target[:, None]).sum().item(),
                               bool((logprobs.argmax(-1) == target).all())))
            out.append(scores)
        return out


@dataclass(kw_only=True)
class Packed:
    """One item's requests in one row: their longest common token prefix once (segment 0), then
    each request's remaining tokens (segment i + 1) with positions continuing from the prefix, so
    every request sees exactly its own sequence. `targets`: per request, the row indices whose
    logits predict its continuation tokens, and those tokens."""

    tokens: list[int]
    positions: list[int]
    segments: list[int]
    targets: list[tuple[list[int], list[int]]]


def _pack(requests: list[tuple[list[int], list[int]]]) -> Packed:
    inputs = [inp for inp, _ in requests]
    shared = len(inputs[0])
    for inp in inputs[1:]:
        shared = next((j for j, (a, b) in enumerate(zip(inputs[0][:shared], inp)) if a != b), min(shared, len(inp)))
    tokens, positions, segments = inputs[0][:shared], list(range(shared)), [0] * shared
    targets = []
    for i, (inp, cont) in enumerate(requests):
        offset = len(tokens) - shared  # where this request's own tokens start, past the prefix
        tokens += inp[shared:]
        positions += range(shared, len(inp))
        segments += [i + 1] * (len(inp) - shared)
        where = [j if j < shared else j + offset for j in range(len(inp) - len(cont), len(inp))]
        targets.append((where, cont))
    return Packed(tokens=tokens, positions=positions, segments=segments, targets=targets)


def _attention_bias(segments: Any, dtype: Any) -> Any:
    """Additive 4D mask (batch, 1, query, key): a token sees earlier tokens of the shared prefix
    and of its own request; padding (segment -1) sees only itself, so no row is all masked."""
    import torch

    n = segments.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=segments.device).tril()
    q, k = segments[:, :, None], segments[:, None, :]
    allowed = causal & ((k == 0) | (k == q)) | torch.eye(n, dtype=torch.bool, device=segments.device)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
