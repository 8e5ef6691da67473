"""Ray Train, started and supervised by a training stage (`launch.backend: ray`):

    python -m infra.ray_train --processes P --nodes N [--gpu] [--mixed-precision bf16] \
        --log-dir DIR MODULE [ARG ...]

This driver joins the Ray cluster RAY_ADDRESS names and runs a TorchTrainer of P x N workers,
spread over N nodes. Ray Train joins them into one torch.distributed group (gloo on CPU, NCCL on
GPU), and each worker calls `MODULE.main(ARGS)` (flows.launched: one rank of the stage), whose
Accelerator picks that group up, as it does under `accelerate launch`.

The stage's task runs the driver as it runs Accelerate's launcher (infra/launch.py): the driver's
output reaches the task log, a signal to it ends its Ray job and so every worker, and its exit
status says whether every rank finished. Each worker writes its output to DIR/rank-N.log, on
storage every node sees (the stage's store), and the driver prints those lines as `[rankN]:...`,
the prefix Accelerate's launcher gives. When a worker fails, the last line the driver prints is
FAILED_PREFIX followed by the rank and its error.
"""
from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from core.launch import PRECISION_VAR
from infra import env
from infra.launch import FAILED_PREFIX

RELAY_EVERY_S = 0.3
# What a worker needs of the driver's environment: the store, the shared data, the offline switches.
PASSED_VARS = ("GRISTMILL_", "HF_", "TOKENIZERS_", "OMP_NUM_THREADS", "PYTHONPATH")


def _worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: its output into its rank's log file, then one rank of the stage."""
    import ray
    import ray.train

    context = ray.train.get_context()
    rank = context.get_world_rank()
    with open(Path(config["log_dir"]) / f"rank-{rank}.log", "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    for stream in (sys.stdout, sys.stderr):  # a text file over the log (typed as any TextIO)
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    os.chdir(config["cwd"])  # relative paths in the config mean what they mean to the driver
    if config["mixed_precision"]:
        os.environ[PRECISION_VAR] = config["mixed_precision"]
    print(f"rank {rank} of {context.get_world_size()} on node {ray.get_runtime_context().get_node_id()} "
          f"(pid {os.getpid()})")
    code = importlib.import_module(config["module"]).main(config["args"])
    if code:
        raise RuntimeError(f"{config['module']} exited with {code}")


class _RankLogs(threading.Thread):
    """Prints each rank's new log lines, `[rankN]:` in front, until stopped (then drains)."""

    def __init__(self, log_dir: Path, emit: Callable[[str], None]):
        super().__init__(name="gristmill-rank-logs", daemon=True)
        self.log_dir, self.emit = log_dir, emit
        self.offsets: dict[Path, int] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(RELAY_EVERY_S):
            self.drain()

    def drain(self) -> None:
        for path in sorted(self.log_dir.glob("rank-*.log")):
            offset = self.offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[path] = offset + len(complete)
            rank = path.stem.removeprefix("rank-")
            for line in complete.decode(errors="replace").splitlines():
                self.emit(f"[rank{rank}]:{line}")

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.drain()


def _died(error: BaseException) -> bool:
    """Whether a worker's failure is its process ending (a kill, the OOM killer) rather than an
    exception it raised: Ray reports the actor dead, or its health check failing."""
    from ray.exceptions import RayActorError

    return isinstance(error, RayActorError) or getattr(error, "health_check_failure", None) is not None


def _why(rank: int, error: BaseException) -> str:
    """One line for a worker's failure: how its process ended, or its own exception."""
    from ray.exceptions import RayTaskError

    if _died(error):
        return f"rank {rank}: its process died (killed, or out of memory)"
    if isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    first = (str(error).strip().splitlines() or [""])[0]
    return f"rank {rank}: {type(error).__name__}: {first}"


def failure_line(error: BaseException) -> str:
    """The line naming the failed rank(s) of a Ray Train run, without FAILED_PREFIX. A rank whose
    process died takes the others' collective calls down with it: it alone is named then."""
    from ray.train import WorkerGroupError

    if isinstance(error, WorkerGroupError) and error.worker_failures:
        failures = dict(sorted(error.worker_failures.items()))
        died = {rank: e for rank, e in failures.items() if _died(e)}
        return "; ".join(_why(rank, e) for rank, e in (died or failures).items())
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def train(module: str, args: Sequence[str], *, processes: int, nodes: int, gpu: bool, log_dir: Path,
          mixed_precision: str | None = None) -> None:
    """Run `module.main(args)` on processes x nodes Ray Train workers of the RAY_ADDRESS cluster;
    raises the trainer's error when a worker fails."""
    from infra.ray_engine import RayEngine  # keeps Ray on loopback: imported before Ray

    # isort: split
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    address = os.environ.get("RAY_ADDRESS")
    if not address:
        raise SystemExit("launch.backend ray: RAY_ADDRESS is not set; point it at the Ray cluster's head")
    # Ray Train sends a worker's print() to its logger as well: each line would come out twice.
    passed = {**{k: v for k, v in os.environ.items() if k.startswith(PASSED_VARS)},
              "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    RayEngine(processes * nodes, runtime_env={"env_vars": passed}).start()  # joins RAY_ADDRESS's cluster
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) < nodes:
        raise SystemExit(f"launch.nodes: {nodes}, and the Ray cluster at {address} has {len(alive)} alive "
                         f"node(s); add nodes (`ray start --address {address}` on each) or lower launch.nodes")
    # One worker a node must land on distinct nodes; several a node are spread as evenly as Ray can.
    placement = "PACK" if nodes == 1 else "STRICT_SPREAD" if processes == 1 else "SPREAD"
    log_dir.mkdir(parents=True, exist_ok=True)
    relay = _RankLogs(log_dir, lambda line: print(line, flush=True))
    relay.start()
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"module": module, "args": list(args), "log_dir": str(log_dir.resolve()),
                           "cwd": os.getcwd(), "mixed_precision": mixed_precision},
        scaling_config=ScalingConfig(num_workers=processes * nodes, use_gpu=gpu, placement_strategy=placement),
        run_config=RunConfig(name="gristmill", storage_path=str(log_dir.resolve() / "ray"),
                             failure_config=FailureConfig(max_failures=0)))
    try:
        trainer.fit()
    finally:
        relay.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.ray_train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=1, help="workers per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"))
    parser.add_argument("--log-dir", type=Path, required=True, help="the ranks' log files (shared storage)")
    parser.add_argument("module", help="each worker runs this module's main(args)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    env.configure()
    try:
        train(args.module, args.args, processes=args.processes, nodes=args.nodes, gpu=args.gpu,
              log_dir=args.log_dir, mixed_precision=args.mixed_precision)
    except Exception as error:  # every failure ends in one line the stage reports
        print(f"{FAILED_PREFIX}{failure_line(error)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
