"""What a committed output must be to count, checked alike when a run reuses it and by
`gristmill verify`: a manifest of the right shape that names its own stage and key and carries its
seal, the files its stage's contract requires listed, and every listed file present as a
readable regular file with its recorded size (and sha256), with nothing unlisted beside them.

This module knows what a manifest holds, not where outputs live (that is infra/artifacts.py's
alone). The seal is the sha256 of the manifest's canonical JSON without the seal itself, written
at commit: an edit of any field (a stat, an upstream key, a file's record) shows. File problems
are keyed by the file's path relative to the output folder; problems of the manifest itself by
`manifest.json`.

Root reads what its mode forbids, so a file whose owner may not read it (mode 0o000, say) is
reported by its mode bits, not only when a read fails: the finding is the same whoever runs the
check.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import stat
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal

from gristmill.core.files import file_digest

MANIFEST = "manifest.json"
SEAL = "seal"  # sha256 of the manifest's canonical JSON without this field
# Every field of a manifest (core.stage.Manifest.to_json) and the JSON type it must have.
FIELDS: dict[str, type] = {"stage": str, "key": str, "config": dict, "upstream": dict, "files": dict,
                           "stats": dict, "meta": dict}
SMALL_FILE_BYTES = 1 << 20  # files this small are hashed whenever an output is reused
VerifyMode = Literal["size", "sha256"]
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
UNSEALED = "no seal: committed before manifests were sealed"  # the one problem `verify --repair` mends in place


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def seal_of(record: Mapping[str, Any]) -> str:
    """The seal of a manifest record: sha256 of its canonical JSON, the seal field left out."""
    body = {name: value for name, value in record.items() if name != SEAL}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def manifest_text(record: Mapping[str, Any]) -> str:
    """The manifest file's content for `record`, as a commit writes it."""
    return json.dumps(record, indent=2, sort_keys=True)


def read_manifest(directory: Path) -> tuple[dict[str, Any] | None, str]:
    """(the parsed manifest of `directory`, "") or (None, why it cannot be read)."""
    record, why, _ = _read(Path(directory) / MANIFEST)
    return record, why


def checked_manifest(directory: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The parsed manifest of `directory` (None when it cannot be read) and what is wrong with its
    file: unreadable, or not byte for byte what a commit writes for its content (an edit, or a
    flipped bit that JSON reads the same, 1e-05 for 1E-05)."""
    record, why, raw = _read(Path(directory) / MANIFEST)
    if record is None:
        return None, [why]
    return record, [] if raw == manifest_text(record).encode() else ["its bytes are not as committed"]


def _read(path: Path) -> tuple[dict[str, Any] | None, str, bytes]:
    if (why := _not_readable_file(path)) is not None:
        return None, why, b""
    try:
        raw = path.read_bytes()
        record = json.loads(raw)
    except OSError as error:
        return None, f"unreadable: {error.strerror}", b""
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None, "not JSON", b""
    return (record, "", raw) if isinstance(record, dict) else (None, "not a JSON object", b"")


def manifest_problems(record: Mapping[str, Any], stage: str, key: str, required: Collection[str]) -> list[str]:
    """What is wrong with the parsed manifest of output (stage, key): fields missing, unknown or of
    another type, another stage or key than its folder's, its seal, file records that are not
    {bytes, sha256} at a path inside the folder, and required files (glob patterns) it lists none of."""
    problems = [f"no field {name!r}" for name in FIELDS if name not in record]
    problems += [f"unknown field {name!r}" for name in sorted(set(record) - set(FIELDS) - {SEAL})]
    problems += [f"field {name!r} is not a JSON {kind.__name__}" for name, kind in FIELDS.items()
                 if name in record and not isinstance(record[name], kind)]
    for name, expected in (("stage", stage), ("key", key)):
        if name in record and record[name] != expected:
            problems.append(f"names {name} {record[name]!r}, its folder {expected!r}")
    if SEAL not in record:
        problems.append(UNSEALED)
    elif record[SEAL] != seal_of(record):
        problems.append("seal differs: edited after its commit")
    files = record.get("files")
    if isinstance(files, dict):
        well_formed = file_records(record)
        problems += [f"bad record for {rel!r}" for rel in files if rel not in well_formed]
        problems += [f"lists no {pattern}" for pattern in required
                     if not any(fnmatch.fnmatchcase(rel, pattern) for rel in files)]
    return problems


def file_records(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The well-formed entries of a manifest's `files`: a relative path inside the folder (no `..`,
    not the manifest) -> {"bytes": int >= 0, "sha256": 64 hex digits}."""
    files = record.get("files")
    if not isinstance(files, dict):
        return {}
    return {rel: info for rel, info in files.items() if _safe_relative(rel) and _well_formed(info)}


def file_problems(directory: Path, files: Mapping[str, Mapping[str, Any]], mode: VerifyMode) -> dict[str, str]:
    """rel path -> what differs from its record: missing, not a readable regular file, another size,
    or (hashed in mode "sha256", and always for files up to SMALL_FILE_BYTES) another sha256."""
    problems = {}
    for rel, info in files.items():
        path = Path(directory) / rel
        if (why := _not_readable_file(path)) is not None:
            problems[rel] = why
        elif (size := path.stat().st_size) != info["bytes"]:
            problems[rel] = f"{size} bytes, {info['bytes']} recorded"
        elif (mode == "sha256" or info["bytes"] <= SMALL_FILE_BYTES) and \
                (why := _digest_differs(path, info["sha256"])) is not None:
            problems[rel] = why
    return problems


def unlisted(directory: Path, listed: Collection[str]) -> dict[str, str]:
    """rel path -> "unlisted" for each file under `directory` that is neither its manifest nor in
    `listed`, and "unlisted folder" for each top-most folder holding no listed file."""
    holders = {parent.as_posix() for rel in listed for parent in Path(rel).parents if parent != Path(".")}
    expected = set(listed) | {MANIFEST}
    problems: dict[str, str] = {}
    pending = [(Path(directory), "")]
    while pending:
        folder, prefix = pending.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError as error:
            problems[prefix.rstrip("/") or "."] = f"unreadable folder: {error.strerror}"
            continue
        for entry in entries:
            rel = prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                if rel not in holders:
                    problems[rel] = "unlisted folder"
                elif (why := _unreadable_mode(entry.stat(follow_symlinks=False).st_mode, folder=True)) is not None:
                    problems[rel] = why
                else:
                    pending.append((Path(entry.path), rel + "/"))
            elif rel not in expected:
                problems[rel] = "unlisted symlink" if entry.is_symlink() else "unlisted"
    return problems


def remove_empty_folders(directory: Path) -> None:
    """Remove every folder under `directory` that holds no file, deepest first: an output's folders
    are there for the files its manifest lists, and one holding none would count as unlisted."""
    for folder in sorted((p for p in Path(directory).rglob("*") if p.is_dir() and not p.is_symlink()),
                         key=lambda p: len(p.parts), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()


def _not_readable_file(path: Path) -> str | None:
    """Why `path` cannot be read as a regular file (missing, another kind, its mode), or None."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        return f"unreadable: {error.strerror}"
    if not stat.S_ISREG(mode):
        return "not a regular file" + (": a symlink" if stat.S_ISLNK(mode) else "")
    return _unreadable_mode(mode)


def _unreadable_mode(mode: int, folder: bool = False) -> str | None:
    """Why an owner could not read a file (or list a folder) of this mode, or None."""
    needed = stat.S_IRUSR | (stat.S_IXUSR if folder else 0)
    return None if mode & needed == needed else f"unreadable: mode {stat.S_IMODE(mode):03o}"


def _digest_differs(path: Path, recorded: str) -> str | None:
    try:
        return None if file_digest(path) == recorded else "sha256 differs"
    except OSError as error:
        return f"unreadable: {error.strerror}"


def _safe_relative(rel: object) -> bool:
    """A file record's path: relative, normalised, inside the output folder, not its manifest."""
    return isinstance(rel, str) and rel != MANIFEST and not rel.startswith("/") and \
        all(part not in ("", ".", "..") for part in rel.split("/"))


def _well_formed(info: object) -> bool:
    return isinstance(info, dict) and set(info) == {"bytes", "sha256"} and type(info["bytes"]) is int \
        and info["bytes"] >= 0 and isinstance(info["sha256"], str) and SHA256_HEX.fullmatch(info["sha256"]) is not None
