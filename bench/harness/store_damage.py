"""The kinds of damage `python -m bench store-fuzz` (bench/store_fuzz.py, store_fuzz.py beside this one) does
to a copy of a finished store, one function each: `KIND(store, output, rng) -> Harm`, where `output` is the
committed output it was drawn to hit and `Harm` says what a check must find: the entries (and the
files in them) `gristmill verify` must name, the outputs reuse must refuse, and the top-level
entries to restore afterwards. Everything random comes from `rng`, so a seed replays a trial."""
from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.harness.runs import STAGES
from gristmill.infra.artifacts import MANIFEST, ArtifactStore
from gristmill.infra.integrity import FIELDS, SEAL, SMALL_FILE_BYTES, manifest_text, read_manifest


@dataclass(frozen=True)
class Output:
    """A committed output of the undamaged store: (stage, key, folder in the copy), as the store's
    `committed()` names it, and the files its manifest lists."""
    committed: tuple[str, str, Path]
    files: dict[str, dict]

    @property
    def stage(self) -> str:
        return self.committed[0]

    @property
    def key(self) -> str:
        return self.committed[1]

    @property
    def path(self) -> Path:
        return self.committed[2]

    def nonempty(self) -> list[str]:
        """Its listed files that hold a byte, and its manifest."""
        return [rel for rel, info in sorted(self.files.items()) if info["bytes"] > 0] + [MANIFEST]


@dataclass
class Harm:
    """What one trial did: `named` (entry path, rel path in it or None) pairs verify must report;
    `refused` (stage, key) pairs reuse must refuse; `touched` top-level names to restore."""
    what: str
    named: list[tuple[Path, str | None]]
    refused: list[tuple[str, str]]
    touched: set[str]
    unhashed: bool = False  # a same-size change of a file over SMALL_FILE_BYTES: reuse by size cannot see it


def _name(rng: random.Random, prefix: str) -> str:
    return f"{prefix}-{rng.randrange(16 ** 6):06x}"


def _key(rng: random.Random) -> str:
    """Another key, of the form keys have."""
    return f"{rng.randrange(16 ** 12):012x}"


def _folders(out: Output) -> list[str]:
    """Every folder of an output that holds listed files, as rel paths."""
    return sorted({parent.as_posix() for rel in out.files for parent in Path(rel).parents if parent != Path(".")})


def _in_output(out: Output, harm: str, *rels: str, unhashed: bool = False) -> Harm:
    return Harm(harm, [(out.path, rel) for rel in rels], [(out.stage, out.key)], {out.stage}, unhashed)


def delete_file(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    rel = rng.choice(sorted(out.files))
    (out.path / rel).unlink()
    return _in_output(out, f"{rel} deleted", rel)


def delete_manifest(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    (out.path / MANIFEST).unlink()
    return _in_output(out, "manifest.json deleted", MANIFEST)


def delete_folder(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    if not (folders := _folders(out)):
        return delete_file(store, out, rng)
    folder = rng.choice(folders)
    shutil.rmtree(out.path / folder)
    return _in_output(out, f"{folder}/ deleted", *[rel for rel in out.files if rel.startswith(folder + "/")])


def truncate(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    rel = rng.choice(out.nonempty())
    size = rng.randrange((out.path / rel).stat().st_size)
    os.truncate(out.path / rel, size)
    return _in_output(out, f"{rel} cut to {size} bytes", rel)


def flip_bit(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    rel = rng.choice(out.nonempty())
    data = bytearray((out.path / rel).read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    (out.path / rel).write_bytes(bytes(data))
    return _in_output(out, f"{rel}: a bit of byte {at} flipped", rel,
                      unhashed=rel != MANIFEST and len(data) > SMALL_FILE_BYTES)


def manifest_of(path: Path) -> dict:
    """The parsed manifest of a committed output (the fuzzer damages only a store that verifies)."""
    record, why = read_manifest(path)
    if record is None:
        raise RuntimeError(f"store-fuzz: {path}: {why}")
    return record


def _rewrite_manifest(out: Output, change: Callable[[dict], str]) -> Harm:
    record = manifest_of(out.path)
    what = change(record)
    (out.path / MANIFEST).write_text(manifest_text(record))
    return _in_output(out, f"manifest {what}", MANIFEST)


def edit_field(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    def change(record: dict) -> str:
        name = rng.choice([*FIELDS, SEAL])
        if name in ("stage", "key", SEAL):
            record[name] = {"stage": rng.choice([s for s in STAGES if s != out.stage]),
                            "key": _key(rng), SEAL: "0" * 64}[name]
        else:
            return f"{name}: {_edit_leaf(record[name], rng)}"
        return f"{name} -> {record[name]}"
    return _rewrite_manifest(out, change)


def _edit_leaf(value: dict, rng: random.Random) -> str:
    """Change one value somewhere in a JSON object (or add one to an empty object); what changed."""
    path, parent = [], value
    while isinstance(parent, dict) and parent:
        name = rng.choice(sorted(parent))
        if not isinstance(parent[name], dict) or not parent[name] or rng.random() < 0.3:
            old = parent[name]
            parent[name] = _other(old, rng)
            return f"{'.'.join([*path, name])} {old!r:.40} -> {parent[name]!r:.40}"
        path, parent = [*path, name], parent[name]
    parent["added"] = 1
    return f"{'.'.join(path) or '{}'}: a key added"


def _other(value: object, rng: random.Random) -> object:
    """A different JSON value of the same type as `value`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + rng.choice([1, -1, 0.5])
    if isinstance(value, str):
        return value + "x" if not value or rng.random() < 0.5 else value[:-1]
    if isinstance(value, list):
        return [*value, 0]
    if isinstance(value, dict):
        return {**value, "added": 1}
    return 0  # null


def empty_field(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    def change(record: dict) -> str:
        name = rng.choice([*FIELDS, SEAL])
        if rng.random() < 0.5:
            del record[name]
            return f"{name} removed"
        record[name] = rng.choice([{}, "", None, []])
        return f"{name} -> {record[name]!r}"
    return _rewrite_manifest(out, change)


def add_file(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    rel = "/".join(filter(None, [rng.choice(["", *_folders(out)]),
                                 _name(rng, "extra") + rng.choice(["", ".bin", ".json", ".jsonl.gz"])]))
    (out.path / rel).write_bytes(rng.randbytes(rng.randrange(4096)))
    return _in_output(out, f"{rel} added", rel)


def add_folder(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    rel = "/".join(filter(None, [rng.choice(["", *_folders(out)]), _name(rng, "extra")]))
    (out.path / rel / "inner").mkdir(parents=True)
    return _in_output(out, f"{rel}/ added", rel)


def add_entry(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    """Something beside the outputs: a file or folder in a stage's folder or at the top, or a copy of
    an output under another key (its manifest names the first key)."""
    where, key = rng.choice(["stage file", "stage folder", "top file", "top folder", "copy"]), _key(rng)
    parent = out.path.parent if where.startswith("stage") else store.root
    path = store.final_dir(out.stage, key) if where == "copy" else parent / _name(rng, "stray")
    if where == "copy":
        shutil.copytree(out.path, path)
    elif where.endswith("folder"):
        path.mkdir()
    else:
        path.write_bytes(rng.randbytes(100))
    top = path.relative_to(store.root).parts[0]
    if where == "copy":
        return Harm(f"a copy as {path.name}", [(path, MANIFEST)], [(out.stage, key)], {top})
    return Harm(f"{path.relative_to(store.root)} added ({where})", [(path, None)], [], {top})


def rename_file(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    rel = rng.choice(sorted(out.files))
    new = f"{rel}.{rng.choice(['old', 'bak', '1'])}"
    os.replace(out.path / rel, out.path / new)
    return _in_output(out, f"{rel} renamed {Path(new).name}", rel, new)


def rename_folder(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    """A folder inside the output, the output's folder (to another key, or a name outside the
    layout), or its stage's folder renamed."""
    scope = rng.choice(["inner", "output key", "output name", "stage"])
    if scope == "inner" and (folders := _folders(out)):
        old = rng.choice(folders)
        os.replace(out.path / old, out.path / f"{old}.old")
        listed = [rel for rel in out.files if rel.startswith(old + "/")]
        return _in_output(out, f"{old}/ renamed {Path(old).name}.old", listed[0], f"{old}.old")
    source = out.path.parent if scope == "stage" else out.path
    key = _key(rng)
    moved = store.final_dir(out.stage, key) if scope == "output key" else source.with_name(f"{source.name}.old")
    os.replace(source, moved)
    tops = {path.relative_to(store.root).parts[0] for path in (source, moved)}
    what = f"{source.relative_to(store.root)} renamed {moved.name}"
    if scope == "output key":
        return Harm(what, [(moved, MANIFEST)], [(out.stage, out.key), (out.stage, key)], tops)
    return Harm(what, [(moved, None)], [(out.stage, out.key)], tops)


def unreadable(store: ArtifactStore, out: Output, rng: random.Random) -> Harm:
    rel = rng.choice([*sorted(out.files), MANIFEST])
    path, how = out.path / rel, rng.choice(["mode 000", "a folder", "a FIFO", "a dangling symlink"])
    if how == "mode 000":
        path.chmod(0)
    else:
        path.unlink()
        {"a folder": path.mkdir, "a FIFO": lambda: os.mkfifo(path),
         "a dangling symlink": lambda: path.symlink_to(path.with_name("nowhere"))}[how]()
    return _in_output(out, f"{rel}: {how}", rel)


KINDS: dict[str, Callable[[ArtifactStore, Output, random.Random], Harm]] = {
    f.__name__: f for f in (delete_file, delete_manifest, delete_folder, truncate, flip_bit, edit_field,
                            empty_field, add_file, add_folder, add_entry, rename_file, rename_folder, unreadable)}
