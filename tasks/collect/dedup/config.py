"""Near dedup's settings and the shape of one run's spilled files.

`DedupConfig` is what the collect stage's config holds (`collect.dedup`; exact dedup's partition
size is one of its fields); `Run` is where one near dedup keeps its spilled files and how it cuts
them, and `ROW` the bucket row those files (and the persisted index's shards) hold. near.py runs
the steps, index.py reads and writes the persisted index.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gristmill.tasks.collect.output import spill

ROW = np.dtype([("key", "<u8"), ("col", "<u2"), ("node", "<i8")])  # a bucket row: 18 bytes


class DedupConfig(BaseModel):
    """How documents are shingled, hashed and judged near-duplicate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shingle_words: int = Field(default=5, ge=1, description="Words per shingle (word n-gram size).")
    # A pair of Jaccard similarity s shares a bucket in at least one band of one layout with
    # probability about 1 - (1 - s**rows)**(bands * band_layouts) (the second layout's bands
    # share one value with each of `rows` first-layout bands, so they are nearly independent):
    # for 18 x 6 and two layouts 0.43 at s=0.5, 0.82 at 0.6, 0.99 at 0.7 (one layout: 0.25,
    # 0.58, 0.90). The exact-Jaccard check then decides, so more candidates cost time, never
    # precision. Measured on neardup_set.py (seeds 0-3, 1,976-2,011 docs; docs/benchmarks.md#near-dedup),
    # precision 1.0 everywhere; recall 0.95-0.96 with one layout checked at 0.6, 0.97-0.98 with
    # two, 0.98-0.99 with two checked at 0.55 (datatrove at 18 x 6, no check: 0.955-0.972).
    # Below 0.55 the labelled set gains little and real pages sharing only a site's navigation
    # (0.49 in that set) come close.
    bands: int = Field(default=18, ge=1, description="LSH bands; bands x rows = hash permutations.")
    rows: int = Field(default=6, ge=1, description="Signature values per band (all must match for two "
                                                   "documents to share the band's bucket).")
    band_layouts: int = Field(default=2, ge=1, le=2, description="Ways the signature is cut into bands "
                                                                 "(1: consecutive values; 2: also one "
                                                                 "value of each of `rows` bands).")
    threshold: float = Field(default=0.55, gt=0, le=1, description="Jaccard similarity of shingle sets "
                                                                    "at or above which two documents are "
                                                                    "near-duplicates (exact for two input "
                                                                    "documents, estimated from the "
                                                                    "signatures against the index).")
    seed: int = Field(default=1, ge=0, description="Seed of the hash permutations. Signatures (and a "
                                                   "persisted index) are comparable only under one seed.")
    chunk_docs: int = Field(default=1024, ge=1, description="Documents per signature task (independent "
                                                            "of the worker count; results do not change).")
    partition_mb: float = Field(default=16, gt=0, description="Spilled rows per partition task: near "
                                                               "dedup's bucket rows (18 bytes a band of a "
                                                               "document, index included) and exact "
                                                               "dedup's hashes (24 bytes a document); "
                                                               "smaller: more tasks for the workers to "
                                                               "share, each holding less. Results do not "
                                                               "change; the index's shards do.")

    @model_validator(mode="after")
    def _check_permutations(self) -> DedupConfig:
        if self.bands * self.rows > 4096:
            raise ValueError(f"bands x rows: {self.bands} x {self.rows} = "
                             f"{self.bands * self.rows} permutations; use at most 4096")
        return self

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    def lsh_threshold(self) -> float:
        """Jaccard similarity where the banding S-curve is steepest, about (1/bands)**(1/rows)."""
        return (1 / self.bands) ** (1 / self.rows)

@dataclass(frozen=True, kw_only=True)
class Run:
    """Where one near dedup keeps its spilled files (a path or URL its workers reach; a killed
    run's finished chunks and partitions are reused from here), and how they are cut."""

    work_dir: str
    cfg: DedupConfig
    bits: int  # 2**bits partitions of the bucket keys, by their top bits
    m: int  # index documents: nodes 0..m-1; input document i is node m + i

    def file(self, kind: str, n: int) -> str:
        return spill.file_in(self.work_dir, kind, n)
