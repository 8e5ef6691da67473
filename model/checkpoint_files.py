"""What the two places of training checkpoints share (model/checkpoint_local.py's, on this
machine's disk, and model/checkpoint_bucket.py's): a checkpoint's directory name; its marker
(`MARKER`: the loop state and every file's size and sha256, written last) and how it is read,
written and replaced; the verification of a local checkpoint's files against it; the error a full
disk gives; and the sync point at which every rank of a run learns the others' answer.
"""
from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gristmill.core.files import DiskSpaceError, file_digest

MARKER = "checkpoint.json"  # written last inside a checkpoint: its completion marker
FILES_KEY = "files"  # in the marker: relative path -> {"bytes", "sha256"}
log = logging.getLogger("gristmill.checkpoint")

Barrier = Callable[[], None]
WriteFn = Callable[[Path], None]


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def read_marker(path: Path) -> dict[str, Any]:
    """The loop state saved with a (local) checkpoint."""
    marker = json.loads((Path(path) / MARKER).read_text())
    marker.pop(FILES_KEY, None)
    return marker


def damage(path: Path) -> str | None:
    """Why a complete local checkpoint cannot be trusted (a file missing, truncated or changed), or None."""
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


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def marker_text(state: dict[str, Any], files: dict[str, Any]) -> str:
    return json.dumps({**state, FILES_KEY: files}) + "\n"


def replace_marker(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a local checkpoint's marker with `state`, atomically; returns its file records."""
    files = json.loads((Path(path) / MARKER).read_text()).get(FILES_KEY, {})
    tmp = Path(path) / (MARKER + ".tmp")
    tmp.write_text(marker_text(state, files))
    os.replace(tmp, Path(path) / MARKER)
    return files


def disk_full(error: OSError, where: Path) -> OSError:
    if error.errno == errno.ENOSPC:
        return DiskSpaceError(errno.ENOSPC, f"disk full while writing a checkpoint to {where} "
                                            f"({error}); the earlier checkpoints are intact")
    return error


def gather(value: Any) -> list[Any]:
    """`value` of every process of the run (a sync point), in rank order; [value] alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out

