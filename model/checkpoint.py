"""The on-disk layout of training checkpoints, shared by the training loop (model/loop.py) and PPO
(model/ppo.py).

    <work_dir>/checkpoints/step-0000050/   one complete checkpoint
        ...                                what the trainer wrote (safetensors weights, tensors, JSON)
        checkpoint.json                    the loop state and every file's size and sha256;
                                           written last: the completion marker

A checkpoint is written into `tmp-step-*` and renamed once its marker is in place, so a crash or a
full disk mid-write leaves the previous checkpoints as they were and a directory without a marker,
which the next run deletes. Free space is checked before writing. Only the newest `keep` complete
checkpoints stay: with the loop's step-0 rollback anchor that is still `keep` directories, since
the anchor is the oldest and goes first. On resume each checkpoint is verified against its
digests, newest first; a damaged one (flipped or truncated bytes) is reported and deleted, and the
one before it is used.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.faults import fault_point
from core.files import DiskSpaceError, describe_files, ensure_free_space, file_digest

MARKER = "checkpoint.json"  # written last inside a checkpoint: its completion marker
CHECKPOINTS_DIR = "checkpoints"
FILES_KEY = "files"  # in the marker: relative path -> {"bytes", "sha256"}
log = logging.getLogger("gristmill.checkpoint")


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
    marker = json.loads((Path(path) / MARKER).read_text())
    marker.pop(FILES_KEY, None)
    return marker


def rewrite_marker(path: Path, state: dict[str, Any]) -> None:
    """Replace a checkpoint's loop state atomically, keeping its file digests (the checkpoint
    stays complete throughout)."""
    files = json.loads((Path(path) / MARKER).read_text()).get(FILES_KEY, {})
    tmp = Path(path) / (MARKER + ".tmp")
    tmp.write_text(json.dumps({**state, FILES_KEY: files}) + "\n")
    os.replace(tmp, Path(path) / MARKER)


def damage(path: Path) -> str | None:
    """Why a complete checkpoint cannot be trusted (a file missing, truncated or changed), or None."""
    files = json.loads((Path(path) / MARKER).read_text()).get(FILES_KEY)
    for name, expected in (files or {}).items():
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, {expected['bytes']} were written"
        if file_digest(file) != expected["sha256"]:
            return f"{name} does not match its sha256"
    return None


def latest_good_checkpoint(work_dir: Path, main: bool = True) -> tuple[int, Path] | None:
    """The newest complete checkpoint that verifies; damaged newer ones are logged and, by the
    main process, deleted (every process reaches the same verdict on the same files)."""
    for step, path in reversed(complete_checkpoints(work_dir)):
        reason = damage(path)
        if reason is None:
            return step, path
        log.warning("checkpoint %s is damaged (%s); falling back to the one before it", path, reason)
        if main:
            shutil.rmtree(path, ignore_errors=True)
    return None


def resume_point(work_dir: Path, *, main: bool = True,
                 barrier: Callable[[], None] = lambda: None) -> tuple[int, Path] | None:
    """Where a (re)started training run resumes: the newest complete checkpoint that verifies,
    once the main process has removed what a crash left half-written; None to start afresh.
    Every process of a distributed run calls it and gets the same answer (`barrier` syncs them)."""
    if main:
        clear_partial_checkpoints(work_dir)
    barrier()
    good = latest_good_checkpoint(work_dir, main=main)
    barrier()
    return good


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def save_checkpoint(work_dir: Path, state: dict[str, Any], keep: int, write: Callable[[Path], None], *,
                    expected_bytes: int = 0, main: bool = True, barrier: Callable[[], None] = lambda: None) -> None:
    """Write checkpoint `state["step"]`: `write(directory)` fills it (in every process of a
    distributed run; `barrier` syncs them), then the main process adds the marker with every
    file's digest, renames it into place and deletes all but the newest `keep` complete
    checkpoints. Needs free space for the last checkpoint's size (or `expected_bytes` for the
    first); a write that fails removes its temporary directory and leaves the others intact."""
    root = _root(work_dir)
    final, tmp = root / f"step-{state['step']:07d}", root / f"tmp-step-{state['step']:07d}"
    previous = complete_checkpoints(work_dir)
    ensure_free_space(root, max(expected_bytes, checkpoint_bytes(previous[-1][1]) if previous else 0), "a checkpoint")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    try:
        write(tmp)
        barrier()
        if main:
            marker = {**state, FILES_KEY: describe_files(tmp, exclude=MARKER)}
            (tmp / MARKER).write_text(json.dumps(marker) + "\n")
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if error.errno == errno.ENOSPC:
            raise DiskSpaceError(errno.ENOSPC, f"disk full while writing a checkpoint to {tmp} "
                                               f"({error}); the earlier checkpoints are intact") from error
        raise
    if main:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for _, old in complete_checkpoints(work_dir)[:-keep]:
            shutil.rmtree(old)
        fault_point(f"checkpoint:{state['step']}")
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

