"""Sequence packing for fine-tuning: several short examples share one row, without seeing each other.

`pack_examples` concatenates (input ids, labels) examples into rows of at most `max_seq_len`
tokens with TRL's best-fit-decreasing packer (`trl.pack_dataset`), which keeps every example
whole. `collate_packed` gives each row `position_ids` that restart at 0 at every example, and the
padding at a row's end its own run from 0. The model is then called with those `position_ids` and
no `attention_mask`: transformers (>= 4.54; checked on 5.24 with sdpa and eager attention) reads
each restart as a sequence boundary and builds a block-diagonal causal mask, so each example's
logits equal those of the example run alone (tests/tasks/sft/test_sft.py checks it). That detection is off
whenever a 2D attention mask or a KV cache is passed, hence `use_cache=False` (`gristmill.model.loop.model_inputs`).
Labels are already shifted within each example, so no label crosses from one example to the next.
With no attention_mask, the loop's `tokens_seen` / `tokens_per_s` count a packed batch's padding too
(a few percent: rows come out nearly full).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gristmill.model.loop import IGNORE_INDEX, Batch, model_inputs

Example = tuple[list[int], list[int]]  # (input ids, labels aligned to them; IGNORE_INDEX = no loss)
PackedRow = tuple[list[int], list[int], list[int]]  # (input ids, labels, lengths of its examples)


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Hide the `datasets` progress bar of the in-memory map that packs (a stage logs its own)."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def pack_examples(examples: list[Example], max_seq_len: int) -> list[PackedRow]:
    """Rows of whole examples, each row at most `max_seq_len` tokens (best-fit decreasing, so
    rows come out nearly full); deterministic for a given input order. Examples longer than
    `max_seq_len` are an error: truncate them first, so truncation is counted where it happens."""
    too_long = [i for i, (ids, _) in enumerate(examples) if len(ids) > max_seq_len]
    if too_long:
        raise ValueError(f"{len(too_long)} examples exceed max_seq_len={max_seq_len} tokens (first: #{too_long[0]})")
    try:
        from datasets import Dataset
        from trl.data_utils import pack_dataset
    except ImportError as exc:
        raise ImportError("packing needs trl and datasets: pip install trl datasets") from exc
    table = Dataset.from_dict({"input_ids": [ids for ids, _ in examples], "labels": [lab for _, lab in examples]})
    with _quiet_datasets():
        # One map batch over everything: BFD bins across the whole set, not per 1000 examples.
        packed = pack_dataset(table, seq_length=max_seq_len, strategy="bfd",
                              map_kwargs={"batch_size": max(len(examples), 1)})
    if not isinstance(packed, Dataset):  # pack_dataset returns the kind of dataset it is given
        raise TypeError(f"pack_dataset returned a {type(packed).__name__}, not a Dataset")
    return [(row["input_ids"], row["labels"], row["seq_lengths"]) for row in packed.to_list()]


def position_ids_of(lengths: list[int], width: int) -> list[int]:
    """Positions restarting at 0 for each example, then for the padding up to `width`."""
    positions = [p for n in lengths for p in range(n)]
    return positions + list(range(width - len(positions)))


def collate_packed(rows: list[PackedRow], pad_id: int) -> Batch:
    """A batch of packed rows, right-padded to the longest: input_ids, labels (IGNORE_INDEX on
    padding) and position_ids. No attention_mask on purpose (see the module docstring)."""
    width = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, labs, lengths) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(labs)] = torch.tensor(labs)
        positions[r] = torch.tensor(position_ids_of(lengths, width))
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions}


def packed_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Logits of a packed batch, each example attending only to itself."""
    return model(**model_inputs(batch)).logits
