"""A training stage computed in the processes its `launch` section asks for (core/launch.py).

`backend: accelerate`: the stage's Prefect task starts Accelerate's launcher with one
`python -m gristmill.flows.launched` rank per process (infra/launch.py supervises it); `backend: ray`:
the Ray Train driver (infra/ray_train.py), whose workers run the same ranks, supervised alike. The ranks plan the
run from this run's config, so they train into the stage's `.partial` directory (the one the task's
store lock guards, or its namesake on another node's disk), and open the store as the task does, so
their checkpoints go where its `store_mapping` puts them (model/checkpoint.py); rank 0 hands the
stats back in a file (through Ray from another node), and the task commits the manifest only once
every rank exited 0.
Their log lines reach the task's log with the rank in front; the step metrics reach MLflow from
rank 0's metrics.jsonl (flows/pipeline.py follows it). Ray Train's nodes need no disk of this
machine's when the store is on a bucket: rank 0 uploads its outputs there and the task downloads
them into its `.partial` directory before committing (`upload_outputs`, `download_outputs`).

The same ranks, started by hand on each node of a cluster without Ray, commit the artifact
themselves (`--commit`): `per_node_command` is what `gristmill run --dry-run` prints for it.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import tempfile
from pathlib import Path

from gristmill.core import object_store, progress
from gristmill.core.launch import REPO, LaunchConfig, on_cuda
from gristmill.core.stage import StageResult
from gristmill.flows.config import PipelineConfig
from gristmill.flows.dag import PlannedStage, stage_device
from gristmill.infra.artifacts import ArtifactStore
from gristmill.infra.launch import PREFIX, accelerate_argv, ray_argv, run_launcher
from gristmill.model.checkpoint import CHECKPOINTS_DIR


def _cuda(stage: PlannedStage) -> bool:
    return on_cuda(stage_device(stage))


def _launch(stage: PlannedStage) -> LaunchConfig:
    if (launch := stage.launch) is None:
        raise ValueError(f"stage {stage.spec.name!r} has no launch section: it is not a training stage")
    return launch


def launched(stage: PlannedStage, config: PipelineConfig, partial_dir: Path,
             logger: logging.Logger | logging.LoggerAdapter, store: ArtifactStore | None = None) -> StageResult:
    """Train `stage` into `partial_dir` under `accelerate launch` (or Ray Train) with its launch's
    processes; raises infra.launch.LaunchFailed (one line) when a rank fails. With Ray and a store
    on a bucket, rank 0 may run on a node that shares no disk with this one: its outputs come
    through the bucket into `partial_dir`."""
    launch = _launch(stage)
    on_ray = launch.backend == "ray"
    via_bucket = on_ray and store is not None and store.remote is not None
    if on_ray and launch.nodes > 1 and not via_bucket:
        logger.warning("%s: launch.nodes=%d with the artifact store on this machine's disk: every node must see "
                       "GRISTMILL_HOME (a shared disk), or set GRISTMILL_STORE=s3://... so that nodes share nothing "
                       "but the bucket", stage.spec.name, launch.nodes)
    with tempfile.TemporaryDirectory(prefix=f".{partial_dir.name}-launch-", dir=partial_dir.parent) as scratch:
        scratch = Path(scratch)
        (scratch / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
        worker = ["-m", "gristmill.flows.launched", str(scratch / "config.json"), stage.spec.name,
                  "--result", str(scratch / "result.json"), *(["--upload"] if via_bucket else [])]
        if on_ray:  # the config goes to the workers' nodes and the result comes back, through Ray
            argv = ray_argv(launch, worker, cuda=_cuda(stage), ship=[scratch / "config.json"],
                            result=scratch / "result.json")
        else:
            argv = accelerate_argv(launch, worker, cuda=_cuda(stage), log_dir=scratch / "logs")
        logger.info("%s: %d x %d processes (%s) into %s: %s", stage.spec.name, launch.nodes, launch.processes,
                    launch.backend, partial_dir, shlex.join(argv))
        # Rank 0 relays its progress (core/progress.py): drawn here, on this console and in the
        # stage's Prefect artifact; its periodic progress lines are marked as such again.
        with progress.Relayed() as relayed:
            run_launcher(argv, on_line=lambda line: _relay(line, relayed, logger),
                         env={**os.environ, progress.RELAY_VAR: "1"})
        result = json.loads((scratch / "result.json").read_text())
    if via_bucket and store is not None:
        download_outputs(store, partial_dir, result["uploaded"])
    # Rank 0 removed the checkpoints once the stage's outputs were exported; a rank beside it on
    # another node, this one, keeps what it wrote of them here (its views of the bucket's
    # checkpoints, its share of a Trainer checkpoint), and none of it belongs in the artifact.
    shutil.rmtree(partial_dir / CHECKPOINTS_DIR, ignore_errors=True)
    return StageResult(stats=result["stats"], artifacts=result["artifacts"], measured=result["measured"])


def _outputs(partial: Path) -> list[str]:
    """A partial folder's outputs: its files but the checkpoints (the stage's own working state)."""
    return sorted(path.relative_to(partial).as_posix() for path in partial.rglob("*")
                  if path.is_file() and path.relative_to(partial).parts[0] != CHECKPOINTS_DIR)


def upload_outputs(store: ArtifactStore, partial: Path) -> list[str]:
    """Rank 0's outputs in `partial` (on its own node) to the partial folder's place on the store's
    bucket, for the driver on another node to commit; returns what it uploaded."""
    remote = store.remote_location(partial)
    files = _outputs(partial)
    object_store.put_files([(partial / rel, f"{remote}/{rel}") for rel in files], "uploading rank 0's outputs")
    return files


def download_outputs(store: ArtifactStore, partial: Path, files: list[str]) -> None:
    """What `upload_outputs` put on the bucket, into the driver's `partial` folder, then off the
    bucket. Each file replaces what is there by a rename, never in place: a rank 0 of an earlier
    try on this node may have written it, and the stage's metrics follower reads it meanwhile."""
    if not files:
        return
    remote = store.remote_location(partial)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=partial) as fetched:
        for rel in files:
            (Path(fetched) / rel).parent.mkdir(parents=True, exist_ok=True)
        object_store.get_files([(f"{remote}/{rel}", Path(fetched) / rel) for rel in files],
                               "downloading rank 0's outputs")
        for rel in files:
            (partial / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(Path(fetched) / rel, partial / rel)
    object_store.remove_files([f"{remote}/{rel}" for rel in files])


def _relay(line: str, relayed: progress.Relayed, logger: logging.Logger | logging.LoggerAdapter) -> None:
    """One line of the ranks' output: progress to `relayed`, the rest to the task log."""
    rank = PREFIX.match(line)
    text = rank.group(2) if rank else line
    if relayed.feed(text):
        return
    if text.startswith(progress.PROGRESS_MARK):
        line = line.replace(progress.PROGRESS_MARK, "", 1)
        logger.info("%s", line, extra={progress.PROGRESS_LINE: True})
    else:
        logger.info("%s", line)


def per_node_command(stage: PlannedStage, config_path: str, overrides: list[str], nodes: int) -> str:
    """The command to run on each of `nodes` machines (NODE_RANK 0 on the machine at HEAD_IP) to
    compute `stage` without Ray: its launch's processes on each, committing into the store that
    GRISTMILL_HOME names, which every node must see."""
    launch = _launch(stage)
    worker = ["-m", "gristmill.flows.launched", config_path, stage.spec.name, *overrides, "--commit"]
    argv = accelerate_argv(launch, worker, cuda=_cuda(stage), num_machines=nodes, machine_rank="NODE_RANK",
                           main_ip="HEAD_IP", port=29500)
    shown = [str(Path(a).relative_to(REPO)) if a.startswith(f"{REPO}/") else a for a in argv[3:]]
    return shlex.join(["accelerate", "launch", *shown])
