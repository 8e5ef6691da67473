"""One rank of a two-process gloo run that checkpoints on a bucket (tests/model/test_checkpoint_store.py),
in a module of its own so that a spawned process imports only what it runs."""
from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from gristmill.model.checkpoint import StoreMapping, checkpoint_place, resume_point, save_checkpoint

STAGE_DIR = Path("pretrain") / "pretrain-0123456789ab.partial"


def save_and_resume(rank: int, port: int, root: str, url: str, results) -> None:
    """Rank `rank` on a node of its own (its own store root and cache): writes its share of
    checkpoint 2 (rank 0 the weights, each rank its RNG file), then resumes from the bucket; puts
    (rank, the save's figures, the resumed step, the files of its local view) on `results`."""
    os.environ["GRISTMILL_CACHE"] = f"{root}/cache"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        place = checkpoint_place(Path(root) / STAGE_DIR, StoreMapping(Path(root), url))

        def write(directory: Path) -> None:
            (directory / f"rng-{rank}.pt").write_bytes(bytes([rank]) * 10)
            if rank == 0:
                (directory / "model.safetensors").write_bytes(b"m" * 100)

        saved = save_checkpoint(place, {"step": 2}, 2, write, main=rank == 0, barrier=dist.barrier)
        good = resume_point(place, main=rank == 0, barrier=dist.barrier)
        assert good is not None
        results.put((rank, saved["checkpoint_bytes"], good[0], sorted(p.name for p in good[1].iterdir())))
        dist.barrier()  # nobody leaves before every rank has reported
    finally:
        dist.destroy_process_group()
