"""Training checkpoints on this machine's disk: `LocalPlace`, the place model/checkpoint.py's
`checkpoint_place` gives a work directory that no bucket maps (model/checkpoint.py lays it out).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from gristmill.core.faults import fault_point
from gristmill.core.files import describe_files, ensure_free_space
from gristmill.model.checkpoint_files import (
    MARKER,
    Barrier,
    WriteFn,
    checkpoint_bytes,
    damage,
    disk_full,
    log,
    marker_text,
    read_marker,
    replace_marker,
    step_name,
)


class LocalPlace:
    """Checkpoints under `root` (`<work_dir>/checkpoints`), written aside and renamed when complete."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def complete(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.root.glob("step-*") if self.root.is_dir() else []:
            if path.is_dir() and (path / MARKER).is_file():
                found.append((read_marker(path)["step"], path))
        return sorted(found)

    def latest_good(self, main: bool) -> tuple[int, Path] | None:
        for step, path in reversed(self.complete()):
            reason = damage(path)
            if reason is None:
                return step, path
            log.warning("checkpoint %s is damaged (%s); falling back to the one before it", path, reason)
            if main:
                shutil.rmtree(path, ignore_errors=True)
        return None

    def at(self, step: int) -> Path:
        """Complete checkpoint `step`, verified; OSError when it is not there or damaged."""
        path = self.root / step_name(step)
        if not (path / MARKER).is_file():
            raise OSError(f"checkpoint {path} is not complete")
        if (reason := damage(path)) is not None:
            raise OSError(f"checkpoint {path} is damaged ({reason})")
        return path

    def clear_partial(self) -> None:
        for path in self.root.glob("*") if self.root.is_dir() else []:
            if path.is_dir() and not (path / MARKER).is_file():
                shutil.rmtree(path)

    def save(self, state: dict[str, Any], keep: int, write: WriteFn, expected_bytes: int, main: bool,
             barrier: Barrier) -> int:
        final, tmp = self.root / step_name(state["step"]), self.root / f"tmp-{step_name(state['step'])}"
        previous = self.complete()
        ensure_free_space(self.root, max(expected_bytes, checkpoint_bytes(previous[-1][1]) if previous else 0),
                          "a checkpoint")
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        files: dict[str, Any] = {}
        try:
            write(tmp)
            barrier()
            if main:
                fault_point(f"checkpoint-files:{state['step']}")
                files = describe_files(tmp, exclude=MARKER)
                (tmp / MARKER).write_text(marker_text(state, files))
        except OSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_full(error, tmp) from error
        if main:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for _, old in self.complete()[:-keep]:
                shutil.rmtree(old)
            fault_point(f"checkpoint:{state['step']}")
        barrier()
        return sum(record["bytes"] for record in files.values())  # the trainer's files (rank 0 knows them)

    def rewrite_marker(self, path: Path, state: dict[str, Any]) -> None:
        replace_marker(path, state)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
