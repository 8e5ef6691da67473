"""Pretraining on a Ray cluster with Ray Train: the same `tasks.pretrain.run` in every worker.

Ray Train's TorchTrainer starts `num_workers` processes (one per GPU with `use_gpu`), joins them
into one torch.distributed group (gloo on CPU, NCCL on GPU), and the training loop's Accelerator
picks that group up, so each worker trains its share of every global batch exactly as under
`torchrun`. The cluster is the one `RAY_ADDRESS` names, else a local Ray (infra/ray_engine.py).

    RAY_ADDRESS=ray://head:10001 python -m infra.ray_train TOKENIZE_DIR OUT_DIR --workers 16 --gpu \
        --config '{"device": "cuda"}'

TOKENIZE_DIR and OUT_DIR must be on storage every node sees. Each worker writes
OUT_DIR/worker-RANK.json (its stats, incl. world_size); worker 0 exports OUT_DIR/model.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra import env
from infra.ray_engine import RayEngine  # first: keeps a local Ray on loopback

# isort: split
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train_worker(args: dict[str, Any]) -> None:
    """One Ray Train worker: run the pretrain stage as one data-parallel process."""
    import torch.distributed as dist

    from core.stage import Manifest, SerialEngine
    from tasks.pretrain.stage import Config, run

    out_dir = Path(args["out_dir"])
    result = run(Config(**args["config"]), out_dir, engine=SerialEngine(),
                 tokenize=Manifest.of_directory("tokenize", Path(args["tokenize_dir"])))
    rank = dist.get_rank() if dist.is_initialized() else 0
    (out_dir / f"worker-{rank}.json").write_text(json.dumps({**result.stats, "rank": rank}) + "\n")


def train_on_ray(tokenize_dir: Path, out_dir: Path, config: dict[str, Any], *, num_workers: int,
                 use_gpu: bool = False) -> list[dict[str, Any]]:
    """Pretrain with `num_workers` Ray Train workers; returns each worker's stats, by rank."""
    engine = RayEngine(num_workers)
    engine.start()  # Ray is started or joined in one place: infra/ray_engine.py
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"tokenize_dir": str(Path(tokenize_dir).resolve()), "out_dir": str(out_dir),
                           "config": config},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(name="pretrain", storage_path=str(out_dir / "ray")))
    try:
        trainer.fit()
    finally:
        engine.shutdown()  # a local Ray started here; a joined cluster is left running
    return [json.loads((out_dir / f"worker-{rank}.json").read_text()) for rank in range(num_workers)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.ray_train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tokenize_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--config", default="{}", help="tasks.pretrain Config fields as a JSON object")
    args = parser.parse_args(argv)
    env.configure()
    stats = train_on_ray(args.tokenize_dir, args.out_dir, json.loads(args.config), num_workers=args.workers,
                         use_gpu=args.gpu)
    print(json.dumps(stats[0], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
