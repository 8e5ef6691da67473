"""The on-disk layout of training checkpoints, shared by the training loop (model/loop.py) and PPO
(model/ppo.py).

    <work_dir>/checkpoints/step-0000050/   one complete checkpoint
        ...                                what the trainer wrote (Accelerate state, tensors)
        checkpoint.json                    the loop state; written last: the completion marker

A checkpoint is written into `tmp-step-*` and renamed once its marker is in place, so a crash
mid-write leaves a directory without a marker, which the next run deletes; only the newest
`keep` complete checkpoints stay.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

MARKER = "checkpoint.json"  # written last inside a checkpoint: its completion marker
CHECKPOINTS_DIR = "checkpoints"


def _root(work_dir: Path) -> Path:
    return Path(work_dir) / CHECKPOINTS_DIR


def complete_checkpoints(work_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with their marker) under `work_dir/checkpoints`, oldest first."""
    root = _root(work_dir)
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        if path.is_dir() and (path / MARKER).is_file():
            found.append((read_marker(path)["step"], path))
    return sorted(found)


def read_marker(path: Path) -> dict[str, Any]:
    """The loop state saved with a checkpoint."""
    return json.loads((Path(path) / MARKER).read_text())


def rewrite_marker(path: Path, state: dict[str, Any]) -> None:
    """Replace a checkpoint's marker atomically (the checkpoint stays complete throughout)."""
    tmp = Path(path) / (MARKER + ".tmp")
    tmp.write_text(json.dumps(state) + "\n")
    os.replace(tmp, Path(path) / MARKER)


def save_checkpoint(work_dir: Path, state: dict[str, Any], keep: int, write: Callable[[Path], None], *,
                    main: bool = True, barrier: Callable[[], None] = lambda: None) -> None:
    """Write checkpoint `state["step"]`: `write(directory)` fills it (in every process of a
    distributed run; `barrier` syncs them), then the main process adds the marker, renames it into
    place and deletes all but the newest `keep` complete checkpoints."""
    root = _root(work_dir)
    final, tmp = root / f"step-{state['step']:07d}", root / f"tmp-step-{state['step']:07d}"
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    write(tmp)
    barrier()
    if main:
        (tmp / MARKER).write_text(json.dumps(state) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for _, old in complete_checkpoints(work_dir)[:-keep]:
            shutil.rmtree(old)
    barrier()


def clear_partial_checkpoints(work_dir: Path) -> None:
    """Remove temporary and unmarked checkpoint directories left by a crash."""
    root = _root(work_dir)
    for path in root.glob("*") if root.is_dir() else []:
        if path.is_dir() and not (path / MARKER).is_file():
            shutil.rmtree(path)


def remove_checkpoints(work_dir: Path) -> None:
    """Delete all checkpoints once a stage's outputs are exported (they are several times the
    model's size and only serve a resume)."""
    shutil.rmtree(_root(work_dir), ignore_errors=True)
