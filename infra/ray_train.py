"""Ray Train, started and supervised by a training stage (`launch.backend: ray`):

    python -m gristmill.infra.ray_train --processes P --nodes N [--gpu] [--mixed-precision bf16] \
        [--max-failures K] [--ship FILE ...] [--result FILE] MODULE [ARG ...]

This driver joins the Ray cluster RAY_ADDRESS names and runs a TorchTrainer of P x N workers,
spread over N nodes. Ray Train joins them into one torch.distributed group (gloo on CPU, NCCL on
GPU), and each worker calls `MODULE.main(ARGS)` (flows.launched: one rank of the stage), whose
Accelerator picks that group up, as it does under `accelerate launch`.

The stage's task runs the driver as it runs Accelerate's launcher (infra/launch.py): the driver's
output reaches the task log, a signal to it ends its Ray job and so every worker, and its exit
status says whether every rank finished. When a worker fails, the last line the driver prints is
FAILED_PREFIX followed by the rank and its error.

The nodes share no disk (any node's disk may vanish with it): nothing passes through a path only
the driver has.
- A `--ship` FILE (the run's config) travels in the trainer's config; each worker writes it into a
  temp folder on its own node and gets that copy where ARGs name FILE.
- The `--result` FILE is one each worker writes on its own node (ARGs name a local path instead);
  rank 0's returns through Ray and the driver writes it at FILE.
- Each worker's output goes to a file on its own node, and its lines to a Ray queue held on the
  driver's node; the driver prints them as `[rankN]:...`, the prefix Accelerate's launcher gives.
- Any other absolute path in ARGs (or the working directory) that the driver has and a worker's
  node lacks fails that worker in one line naming it.
Artifacts travel through the store's bucket (flows/launched.py). A worker group that fails, a lost
node's included, is started again up to `--max-failures` times, on the nodes there are then; the
stage resumes from its last checkpoint.
"""
from __future__ import annotations

import argparse
import importlib
import io
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gristmill.core.launch import PRECISION_VAR
from gristmill.infra import env
from gristmill.infra.launch import FAILED_PREFIX

RELAY_EVERY_S = 0.3
RESULT = "result"  # the queue's record kind of rank 0's result (a log line's is the rank)


class NotOnThisNode(RuntimeError):
    """A worker was given a path that exists on the driver's machine only."""


def _check_paths(config: dict[str, Any]) -> None:
    """Fail in one line on the first path of the driver's that this node lacks."""
    import ray

    for path in [config["cwd"], *config["driver_paths"]]:
        if not os.path.exists(path):
            node = ray.get_runtime_context().get_node_id()[:8]
            raise NotOnThisNode(f"{path} is not on node {node}: only the driver has it (nodes share no disk; "
                                "pass workers the store's bucket or files in every node's image)")


def _local_args(config: dict[str, Any], scratch: Path) -> list[str]:
    """The worker's ARGs: shipped files and the result file replaced by paths on its own node."""
    local: dict[str, str] = {}
    for i, (path, text) in enumerate(config["shipped"].items()):
        copy = scratch / f"shipped-{i}-{Path(path).name}"
        copy.write_text(text)
        local[path] = str(copy)
    if config["result"]:
        local[config["result"]] = str(scratch / "result.json")
    args: list[str] = config["args"]
    return [local.get(arg, arg) for arg in args]


class _LogSender(threading.Thread):
    """Sends the complete lines of a worker's log file to the driver's queue, every RELAY_EVERY_S
    until stopped (then once more)."""

    def __init__(self, path: Path, rank: int, queue: Any):
        super().__init__(name="gristmill-rank-log", daemon=True)
        self.path, self.rank, self.queue = path, rank, queue
        self.offset = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(RELAY_EVERY_S):
            self.send()

    def send(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        lines = complete.decode(errors="replace").splitlines()
        if lines:
            self.queue.put_nowait_batch([(self.rank, line) for line in lines])

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.send()


def _worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: its output into a log file on its node (sent on to the driver), then
    one rank of the stage; rank 0's result back to the driver."""
    import ray
    import ray.train

    context = ray.train.get_context()
    rank = context.get_world_rank()
    scratch = Path(tempfile.mkdtemp(prefix=f"gristmill-rank-{rank}-"))
    log_path = scratch / "output.log"
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    for stream in (sys.stdout, sys.stderr):  # a text file over the log (typed as any TextIO)
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    sender = _LogSender(log_path, rank, config["queue"])
    sender.start()
    try:
        print(f"rank {rank} of {context.get_world_size()} on node {ray.get_runtime_context().get_node_id()} "
              f"(pid {os.getpid()})")
        _check_paths(config)
        os.chdir(config["cwd"])  # relative paths in the config mean what they mean to the driver
        if config["mixed_precision"]:
            os.environ[PRECISION_VAR] = config["mixed_precision"]
        args = _local_args(config, scratch)
        code = importlib.import_module(config["module"]).main(args)
        if code:
            raise RuntimeError(f"{config['module']} exited with {code}")
        if rank == 0 and config["result"]:
            config["queue"].put((RESULT, (scratch / "result.json").read_text()))
    finally:
        sender.stop()
        shutil.rmtree(scratch, ignore_errors=True)  # its log's lines are sent; nothing else is kept


class _Relay(threading.Thread):
    """Takes the workers' records off the queue until stopped (then drains it): log lines are
    printed with `[rankN]:` in front, rank 0's result is kept."""

    def __init__(self, queue: Any, emit: Callable[[str], None]):
        super().__init__(name="gristmill-rank-logs", daemon=True)
        self.queue, self.emit = queue, emit
        self.result: str | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(RELAY_EVERY_S):
            self.drain()

    def drain(self) -> None:
        while records := self.queue.get_nowait_batch(self.queue.qsize()):
            for kind, text in records:
                if kind == RESULT:
                    self.result = text
                else:
                    self.emit(f"[rank{kind}]:{text}")

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


def _driver_paths(args: Sequence[str], skip: set[str]) -> list[str]:
    """The absolute paths in ARGs (or in their `key=value` values) that exist on the driver, but
    those it ships or takes back: each worker checks its node has them too."""
    values = [arg.partition("=")[2] if "=" in arg and not arg.startswith("/") else arg for arg in args]
    return [v for v in values if v.startswith("/") and v not in skip and os.path.exists(v)]


def train(module: str, args: Sequence[str], *, processes: int, nodes: int, gpu: bool,
          mixed_precision: str | None = None, max_failures: int = 1, ship: Sequence[Path] = (),
          result: Path | None = None) -> None:
    """Run `module.main(args)` on processes x nodes Ray Train workers of the RAY_ADDRESS cluster;
    raises the trainer's error once the group of workers has failed more than `max_failures`
    times. Rank 0's `result` file is written at `result` here."""
    from gristmill.infra.ray_engine import RayEngine, driver_env  # keeps Ray on loopback: imported before Ray

    # isort: split
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    address = os.environ.get("RAY_ADDRESS")
    if not address:
        raise SystemExit("launch.backend ray: RAY_ADDRESS is not set; point it at the Ray cluster's head")
    # Ray Train sends a worker's print() to its logger as well: each line would come out twice.
    passed = {**driver_env(), "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    RayEngine(processes * nodes, runtime_env={"env_vars": passed}).start()  # joins RAY_ADDRESS's cluster
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) < nodes:
        raise SystemExit(f"launch.nodes: {nodes}, and the Ray cluster at {address} has {len(alive)} alive "
                         f"node(s); add nodes (`ray start --address {address}` on each) or lower launch.nodes")
    # One worker a node must land on distinct nodes; several a node are spread as evenly as Ray can.
    placement = "PACK" if nodes == 1 else "STRICT_SPREAD" if processes == 1 else "SPREAD"
    # On this node: the queue lives as long as the driver, whichever worker's node is lost.
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
    relay = _Relay(queue, lambda line: print(line, flush=True))
    shipped = {str(path): Path(path).read_text() for path in ship}
    skip = {*shipped, *([str(result)] if result else [])}
    relay.start()
    with tempfile.TemporaryDirectory(prefix="gristmill-ray-train-") as storage:  # Ray Train's own records
        trainer = TorchTrainer(
            _worker,
            train_loop_config={"module": module, "args": list(args), "cwd": os.getcwd(), "queue": queue,
                               "mixed_precision": mixed_precision, "shipped": shipped,
                               "result": str(result) if result else None,
                               "driver_paths": _driver_paths(args, skip)},
            scaling_config=ScalingConfig(num_workers=processes * nodes, use_gpu=gpu, placement_strategy=placement),
            run_config=RunConfig(name="gristmill", storage_path=storage,
                                 failure_config=FailureConfig(max_failures=max_failures)))
        try:
            trainer.fit()
        finally:
            relay.stop()
    if result is not None:
        if relay.result is None:
            raise RuntimeError("rank 0 finished without sending its result")
        result.write_text(relay.result)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gristmill.infra.ray_train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=1, help="workers per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"))
    parser.add_argument("--max-failures", type=int, default=1,
                        help="times a failed worker group (a lost node's included) is started again")
    parser.add_argument("--ship", type=Path, action="append", default=[],
                        help="a file of this machine's the workers read: sent to each worker's node")
    parser.add_argument("--result", type=Path, help="the file rank 0 writes: sent back and written here")
    parser.add_argument("module", help="each worker runs this module's main(args)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    env.configure()
    try:
        train(args.module, args.args, processes=args.processes, nodes=args.nodes, gpu=args.gpu,
              mixed_precision=args.mixed_precision, max_failures=args.max_failures, ship=args.ship,
              result=args.result)
    except Exception as error:  # every failure ends in one line the stage reports
        print(f"{FAILED_PREFIX}{failure_line(error)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
