"""One rank of a training stage started by Accelerate's launcher:

    accelerate launch ... -m gristmill.flows.launched CONFIG STAGE [key=value ...] [--result FILE | --commit]

Every rank plans the run from the same config (so the same artifact key), reads the upstream
artifacts from the store and trains its share into the stage's `.partial` directory (the training
code's Accelerator joins the launcher's process group). Then:

- `--result FILE` (the pipeline's launched backends, flows/launch.py): rank 0 writes the stage's
  stats there; the pipeline commits the manifest once every rank exited 0. With `--upload` (Ray
  Train on nodes that share only the store's bucket) rank 0 first uploads its outputs to the
  partial folder's place on the bucket, and the pipeline downloads them before it commits.
- `--commit` (by hand, one launcher per node: the command `gristmill run --dry-run` prints): once
  every rank has finished, rank 0 commits the manifest, so the pipeline then reuses the artifact.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import gristmill.flows.entry  # noqa: F401  first: configures the process before anything else is imported
from gristmill.core import object_store, progress
from gristmill.core.stage import Manifest, SerialEngine
from gristmill.flows.config import PipelineConfigBase, load_config
from gristmill.flows.dag import PlannedStage, manifest_fields, open_store, plan, run_planned
from gristmill.flows.launch import upload_outputs
from gristmill.infra import env
from gristmill.infra.artifacts import ArtifactStore

log = logging.getLogger("gristmill.launched")


def _planned(config: PipelineConfigBase, stage: str,
             store: ArtifactStore) -> tuple[PlannedStage, dict[str, Manifest]]:
    """The stage as the pipeline plans it, and its committed upstream manifests."""
    planned = {p.spec.name: p for p in plan(config, store, until=stage)}
    target = planned[stage]
    upstream = {}
    for name in target.spec.upstream:
        manifest = store.load(name, planned[name].key)
        if manifest is None:
            shared = "" if store.remote is not None else (
                " on this node (a rank on another node needs GRISTMILL_HOME on a disk every node shares, "
                "or GRISTMILL_STORE=s3://... )")
            raise SystemExit(f"gristmill: {stage} needs {name}-{planned[name].key}, which is not in the "
                             f"store {store.root}{shared}; run `gristmill run CONFIG --until {name}` first")
        upstream[name] = manifest
    return target, upstream


def store_retries_of_every_rank() -> int:
    """The object-store retries of every rank so far, summed (core/object_store.py counts a
    process's own). Every rank asks it once it has finished writing: it is a barrier too."""
    import torch

    from gristmill.model.ranks import Ranks

    [total] = Ranks.of_process_group().total(torch.tensor(float(object_store.retries())))
    return round(total.item())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        from gristmill.model.parallel import leave_process_group  # here: planning a run imports no torch

        leave_process_group()


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gristmill.flows.launched", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("stage")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    done = parser.add_mutually_exclusive_group(required=True)
    done.add_argument("--result", type=Path, help="rank 0 writes the stage's stats here")
    done.add_argument("--commit", action="store_true", help="rank 0 commits the manifest")
    parser.add_argument("--upload", action="store_true",
                        help="with --result: rank 0 uploads its outputs to the store's bucket, for a driver on "
                             "another node (flows/launch.py), and lists them in the result")
    args = parser.parse_args(argv)
    output = logging.StreamHandler(sys.stdout)
    output.addFilter(progress.mark_progress_lines)  # the parent tells progress lines apart by their mark
    logging.basicConfig(level=logging.INFO, handlers=[output], force=True,
                        format="%(progress_mark)s%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    config = load_config(Path(args.config), args.overrides)
    store = open_store(config, env.gristmill_home())
    stage, upstream = _planned(config, args.stage, store)
    if args.commit and store.load(stage.spec.name, stage.key) is not None:
        log.info("%s-%s is committed already; nothing to do", stage.spec.name, stage.key)
        return 0
    partial = store.partial_dir(stage.spec.name, stage.key)
    partial.mkdir(parents=True, exist_ok=True)
    # the mapping of the store this rank opened: a Ray Train worker's node holds its local copy elsewhere
    result = run_planned(stage, upstream, partial, engine=SerialEngine(), store_mapping=store.store_mapping)
    # every rank has finished writing before rank 0 reports or commits; what the ranks' object-store
    # calls cost goes in the stage's stats (a pipeline adds its own process's)
    others = store_retries_of_every_rank() - object_store.retries()
    if rank != 0:
        return 0
    result.stats["store_retries"] = others + object_store.retries()
    if args.result is not None:
        uploaded = upload_outputs(store, partial) if args.upload else []
        args.result.write_text(json.dumps({"stats": result.stats, "artifacts": result.artifacts,
                                           "measured": result.measured, "uploaded": uploaded}))
        return 0
    world, per_node = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    fields = manifest_fields(stage, upstream, result, {"launch": {
        "backend": "accelerate", "processes": per_node, "nodes": world // per_node, "world_size": world}})
    with store.lock(stage.spec.name, stage.key):
        manifest = store.commit(stage.spec.name, stage.key, partial, fields)
    log.info("%s: committed %s", stage.spec.name, manifest.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
