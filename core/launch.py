"""How a training stage's processes are started: the `launch` section of pretrain, sft and align.

    inline       the stage trains in the flow's own process (one CPU or one GPU)
    accelerate   the flow starts Accelerate's launcher with `processes` data-parallel processes on
                 this machine and supervises them (infra/launch.py); on `nodes` machines without
                 Ray, the per-node command `gristmill run --dry-run` prints (flows/launch.py)
    ray          the flow starts a Ray Train driver (infra/ray_train.py): `processes` x `nodes`
                 workers on the Ray cluster RAY_ADDRESS names, supervised the same way

The section is operational: it is not part of the artifact key, and the result does not depend on
it. Each step's global batch is fixed by the stage's config (`batch_size`, or `tokens_per_step`)
and split across the processes, so 1, 2 or 8 processes train the same model up to the order of
floating-point reductions. The manifest's `meta.launch` records the launch that produced it.
"""
from __future__ import annotations

import glob
import os
import socket
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field

from gristmill.core.stage import StageConfig

REPO = Path(__file__).resolve().parents[1]
PRECISION_VAR = "ACCELERATE_MIXED_PRECISION"  # how a launcher hands its mixed precision to the ranks
ACCELERATE_CONFIGS = REPO / "infra" / "accelerate"  # the committed ones: ddp_cpu, ddp_gpu, multinode, ...


class LaunchConfig(StageConfig):
    """The processes a training stage runs in (operational: not part of the artifact key)."""

    backend: Literal["inline", "accelerate", "ray"] = Field(
        default="inline", description="inline: in the flow's own process; accelerate: `accelerate launch` on this "
                                      "machine, supervised by the stage; ray: Ray Train workers on the cluster "
                                      "RAY_ADDRESS names (the one the data stages use), spread over `nodes` nodes.")
    processes: int = Field(default=1, gt=0, description="Data-parallel training processes per node (one per GPU "
                                                        "when the stage's device is CUDA).")
    nodes: int = Field(default=1, gt=0, description=(
        "Machines the processes are spread over: with backend ray, nodes of the Ray cluster; with accelerate "
        "the pipeline launches on this machine only (1), and for more you run the per-node command that "
        "`gristmill run --dry-run` prints on each."))
    max_failures: int = Field(default=1, ge=0, description=(
        "backend ray: times a failed group of workers (one whose node was lost included) is started again, "
        "on the nodes there are then; the stage resumes from its last checkpoint."))
    accelerate_config: str | None = Field(
        default=None, description="Accelerate config file (e.g. infra/accelerate/multinode.yaml, or your own; "
                                  "fsdp_gpu.yaml shards align's trainers). None: infra/accelerate/ddp_gpu.yaml on a "
                                  "GPU, ddp_cpu.yaml on a CPU. `processes` overrides its num_processes.")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        default="auto", description="Mixed precision of a launched stage; auto: the Accelerate config file's (the "
                                    "committed ones: bf16 on GPUs, none on CPUs). An inline stage uses bf16 autocast "
                                    "on CUDA and full fp32 on a CPU.")

    @property
    def world_size(self) -> int:
        return self.processes * self.nodes

    def record(self) -> dict[str, object]:
        """What a manifest's `meta.launch` and the stage's MLflow run say about the launch."""
        return {"backend": self.backend, "processes": self.processes, "nodes": self.nodes,
                "world_size": self.world_size}

    def accelerate_config_path(self, cuda: bool) -> Path:
        """The Accelerate config file: a relative path is looked up in the current directory,
        then in the repository (so `infra/accelerate/ddp_gpu.yaml` works from anywhere)."""
        if self.accelerate_config is None:
            return ACCELERATE_CONFIGS / ("ddp_gpu.yaml" if cuda else "ddp_cpu.yaml")
        path = Path(self.accelerate_config)
        return next((p for p in (path, REPO / path) if p.is_file()), path)


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, without importing torch: CUDA_VISIBLE_DEVICES when set,
    else the device files the driver creates."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def on_cuda(device: str) -> bool:
    """Whether a stage asking for `device` ("auto", "cpu", "cuda") trains on GPUs here."""
    return device == "cuda" or (device == "auto" and visible_gpus() > 0)


def ray_unreachable(address: str | None, timeout_s: float = 2.0) -> str | None:
    """Why the Ray cluster at `address` (RAY_ADDRESS: `host:port`, `ray://host:port`) cannot be
    joined, or None; only a TCP connect, so planning imports no Ray."""
    if not address:
        return "RAY_ADDRESS names no Ray cluster"
    if address == "auto":
        return None
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError):
        return f"no Ray cluster answers at RAY_ADDRESS={address}"
    return None


def sharding_problems(section: str, launch: LaunchConfig, device: str, fsdp: bool) -> list[str]:
    """What is wrong with the sharding of a stage trained by the training loop (model/loop.py),
    which shards the model itself when its `fsdp` is set (`section`: e.g. "pretrain.launch")."""
    stage = section.rsplit(".", 1)[0]
    problems = []
    if fsdp and launch.backend == "inline":
        problems.append(f"{stage}.fsdp: true shards over a launch's processes, and backend inline is one "
                        f"process; set {section}.backend=accelerate (or ray), or {stage}.fsdp=false")
    config = launch.accelerate_config_path(on_cuda(device))
    if launch.backend == "accelerate" and config.is_file() and (
            yaml.safe_load(config.read_text()) or {}).get("distributed_type") == "FSDP":
        problems.append(f"{section}.accelerate_config: {launch.accelerate_config} asks Accelerate for FSDP, "
                        f"which this stage's training loop applies itself; set {stage}.fsdp=true and a DDP "
                        "launch config (infra/accelerate/ddp_gpu.yaml, or leave it unset)")
    return problems


def launch_problems(section: str, launch: LaunchConfig, device: str) -> list[str]:
    """What is wrong with `launch` for a stage training on `device` ("auto", "cpu", "cuda"), one
    line each naming the key (`section` is the config path, e.g. "pretrain.launch") and what to do.
    Checked when a run is planned, before any service starts."""
    if launch.backend == "inline":
        return ([f"{section}.processes: {launch.processes} with backend inline (one process); set "
                 f"{section}.backend=accelerate"] if launch.world_size > 1 else []) + (
            [f"{section}.mixed_precision: {launch.mixed_precision} applies to a launched stage; set "
             f"{section}.backend=accelerate, or leave it auto"] if launch.mixed_precision != "auto" else [])
    problems = []
    if launch.backend == "accelerate" and launch.nodes > 1:
        problems.append(f"{section}.nodes: {launch.nodes} with backend accelerate, which launches on this "
                        "machine only; run the per-node `accelerate launch` command that `gristmill run "
                        f"--dry-run` prints on each of the {launch.nodes} machines, then run the pipeline")
    cuda = on_cuda(device)
    devices, kind = (visible_gpus(), "GPUs") if cuda else (os.cpu_count() or 1, "CPU cores")
    if launch.backend == "accelerate" and launch.processes > devices:
        problems.append(f"{section}.processes: {launch.processes} is more than this machine's {devices} "
                        f"{kind}; set {section}.processes to at most {devices}" if devices else
                        f"{section}.processes: {launch.processes} GPU processes, and this machine has no GPU; "
                        "run it on a GPU machine, or set the stage's device to cpu")
    if launch.backend == "ray" and (why := ray_unreachable(os.environ.get("RAY_ADDRESS"))):
        problems.append(f"{section}.backend: ray, and {why}; start one (eval \"$(gristmill up --print-env)\" "
                        "on this machine) or choose backend accelerate")
    if launch.accelerate_config is not None and not launch.accelerate_config_path(cuda).is_file():
        problems.append(f"{section}.accelerate_config: no such file {launch.accelerate_config!r}; give an "
                        "Accelerate config file (see infra/accelerate/) or leave it unset")
    return problems
