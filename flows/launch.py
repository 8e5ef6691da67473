"""A training stage computed in the processes its `launch` section asks for (core/launch.py).

`backend: accelerate`: the stage's Prefect task starts Accelerate's launcher with one
`python -m flows.launched` rank per process (infra/launch.py supervises it); `backend: ray`:
the Ray Train driver (infra/ray_train.py), whose workers run the same ranks, supervised alike. The ranks plan the
run from this run's config, so they train into the same `.partial` directory the task's store
lock guards; rank 0 hands the stats back in a file, and the task commits the manifest only once
every rank exited 0. Their log lines reach the task's log with the rank in front; the step
metrics reach MLflow from rank 0's metrics.jsonl (flows/pipeline.py follows it).

The same ranks, started by hand on each node of a cluster without Ray, commit the artifact
themselves (`--commit`): `per_node_command` is what `gristmill run --dry-run` prints for it.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import tempfile
from pathlib import Path

from core import progress
from core.launch import REPO, LaunchConfig, on_cuda
from core.stage import StageResult
from flows.config import PipelineConfig
from flows.dag import PlannedStage, stage_device
from infra.launch import PREFIX, accelerate_argv, ray_argv, run_launcher


def _cuda(stage: PlannedStage) -> bool:
    return on_cuda(stage_device(stage))


def _launch(stage: PlannedStage) -> LaunchConfig:
    if (launch := stage.launch) is None:
        raise ValueError(f"stage {stage.spec.name!r} has no launch section: it is not a training stage")
    return launch


def launched(stage: PlannedStage, config: PipelineConfig, partial_dir: Path,
             logger: logging.Logger | logging.LoggerAdapter) -> StageResult:
    """Train `stage` into `partial_dir` under `accelerate launch` with its launch's processes;
    raises infra.launch.LaunchFailed (one line) when a rank fails."""
    launch = _launch(stage)
    # Beside the partial dir, on the store: the ranks of a Ray cluster's other nodes see it too.
    with tempfile.TemporaryDirectory(prefix=f".{partial_dir.name}-launch-", dir=partial_dir.parent) as scratch:
        scratch = Path(scratch)
        (scratch / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
        worker = ["-m", "flows.launched", str(scratch / "config.json"), stage.spec.name,
                  "--result", str(scratch / "result.json")]
        launcher = accelerate_argv if launch.backend == "accelerate" else ray_argv
        argv = launcher(launch, worker, cuda=_cuda(stage), log_dir=scratch / "logs")
        logger.info("%s: %d x %d processes (%s) into %s: %s", stage.spec.name, launch.nodes, launch.processes,
                    launch.backend, partial_dir, shlex.join(argv))
        # Rank 0 relays its progress (core/progress.py): drawn here, on this console and in the
        # stage's Prefect artifact; its periodic progress lines are marked as such again.
        with progress.Relayed() as relayed:
            run_launcher(argv, on_line=lambda line: _relay(line, relayed, logger),
                         env={**os.environ, progress.RELAY_VAR: "1"})
        result = json.loads((scratch / "result.json").read_text())
    return StageResult(stats=result["stats"], artifacts=result["artifacts"])


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
    worker = ["-m", "flows.launched", config_path, stage.spec.name, *overrides, "--commit"]
    argv = accelerate_argv(launch, worker, cuda=_cuda(stage), num_machines=nodes, machine_rank="NODE_RANK",
                           main_ip="HEAD_IP", port=29500)
    shown = [str(Path(a).relative_to(REPO)) if a.startswith(f"{REPO}/") else a for a in argv[3:]]
    return shlex.join(["accelerate", "launch", *shown])
