"""The records an artifact store keeps beside its outputs (infra/artifacts.py's layout):

    <root>/<stage>/<stage>-<key>.gates.jsonl  a person's decisions on the output's data gates
                                              (flows/gates.py), beside it: the output never changes
    <root>/corpus/versions.jsonl              the corpus versions published by data refreshes

`StoreRecords` is a part of ArtifactStore: it needs the store's `root` and `final_dir`."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gristmill.infra.integrity import canonical_json

CORPUS = "corpus"  # not a stage: the chain of corpus versions over collect artifacts


class StoreRecords:
    """Data-gate decisions and corpus versions of the store at `root`."""

    root: Path

    def final_dir(self, stage: str, key: str) -> Path:
        raise NotImplementedError

    # --- data gates: a person's decisions on an output whose numbers tripped a gate (flows/gates.py) ---

    def gate_decisions(self, stage: str, key: str) -> list[dict[str, Any]]:
        """Every decision recorded on (stage, key)'s gates, oldest first."""
        path = self._gates_file(stage, key)
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def add_gate_decision(self, stage: str, key: str, record: dict[str, Any]) -> None:
        """Append one decision: one line, written with a single append."""
        path = self._gates_file(stage, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(canonical_json(record) + "\n")

    def _gates_file(self, stage: str, key: str) -> Path:
        return self.root / stage / f"{stage}-{key}.gates.jsonl"

    # --- corpus versions: collect artifacts chained by data refreshes (flows/refresh.py) ---

    def corpus_versions(self) -> list[dict[str, Any]]:
        """Every published corpus version, oldest first: {version, parent_version, collect_key,
        inputs (input -> its version stamp when collected), stats...}."""
        path = self.root / CORPUS / "versions.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def collect_dir(self, version: dict[str, Any]) -> Path:
        """The collect artifact holding one corpus version's documents and dedup index."""
        return self.final_dir("collect", version["collect_key"])

    def add_corpus_version(self, record: dict[str, Any]) -> None:
        """Publish one version (call under `lock(CORPUS, ...)`, so numbers follow each other); the
        file is replaced atomically, so a crash leaves the chain as it was before or after."""
        path = self.root / CORPUS / "versions.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(canonical_json(r) + "\n" for r in [*self.corpus_versions(), record])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(lines)
        os.replace(tmp, path)
