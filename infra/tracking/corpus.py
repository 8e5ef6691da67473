"""A data refresh's corpus versions in MLflow: the version a refresh run published and the one it
extends, as dataset inputs of that run (flows/refresh.py; the chain itself is kept by the
artifact store, infra/artifacts.py)."""
from __future__ import annotations

from gristmill.core.stage import Manifest
from gristmill.infra.tracking.runs import Tracker, artifact_input


def log_corpus_version(tracker: Tracker, run_id: str, version: int, manifest: Manifest,
                       parent: tuple[int, Manifest] | None) -> None:
    """Run `run_id`'s lineage: the corpus version it published (dataset `corpus-v<N>`, context
    `corpus-version`) and the version it extends (context `parent-corpus-version`), each with
    digest = its collect artifact key, plus tags naming both."""
    versions = [(version, manifest, "corpus-version")]
    if parent is not None:
        versions.append((*parent, "parent-corpus-version"))
    tracker.log_inputs(run_id, [artifact_input(f"corpus-v{n}", m, "gristmill-corpus", context)
                                for n, m, context in versions])
    tracker.set_tags(run_id, {"gristmill.corpus.version": str(version), "gristmill.corpus.key": manifest.key,
                              "gristmill.corpus.parent_version": str(parent[0]) if parent else "none"})
