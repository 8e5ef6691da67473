"""`gristmill verify`: every entry under the artifact store accounted for, every committed output
checked against its sealed manifest (each file re-hashed), and `--repair`.

    gristmill verify                     # the whole store; exit 0 only when nothing is wrong
    gristmill verify --stage tokenize    # one stage's folder
    gristmill verify --repair            # set aside what is damaged or unknown, seal old manifests

One line per entry: `ok` or `DAMAGED` (each problem named: a file missing, of another size or
sha256, unreadable or unlisted; the manifest missing, unreadable, of another shape, stage or key,
or edited after its commit) for a committed output; `UNKNOWN` for anything the store's layout
(infra/artifacts.py) does not name; `partial` (work in progress, resumed by the next run of its
key), `set aside` (kept to look at by an earlier --repair, never reused) and `download` for the
rest. Lock files, gate decisions and corpus versions are counted. A damaged output or an unknown
entry is a finding: the command exits 1, naming the command that repairs it.

`--repair` moves each damaged output, with every output computed from it, aside
(`<dir>.corrupt-<time>`), so the next run recomputes them, and each unknown entry too (nothing is
deleted); an output whose one finding is a manifest committed before manifests were sealed, its
files all checked, is sealed in place instead. A repair that would write where it cannot (a
read-only store) is refused before anything is moved: `StoreNotWritable`, one line.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

from gristmill.infra import env
from gristmill.infra.artifacts import MANIFEST, ArtifactStore, Entry
from gristmill.infra.integrity import UNSEALED

# What each kind of entry that is not a finding is, said once on its line.
MEANING = {"partial": "work in progress: the next run of this key resumes it",
           "set aside": "kept to look at by an earlier --repair, never reused: delete it when done",
           "download": "a download from the remote store, in progress or stopped (never read)"}
COUNTED = ("lock", "gates", "corpus")  # counted in the summary, not listed
COUNT_OF = {"partial": "partial", "set aside": "set aside", "download": "download(s)", "lock": "lock file(s)",
            "gates": "gate record(s)", "corpus": "corpus file(s)"}
SEAL, SET_ASIDE = "seal", "set aside"  # what a repair does to a path


class StoreNotWritable(Exception):
    """--repair would write in a folder of the store that cannot be written; nothing was changed."""


def verify(store: ArtifactStore, stage: str | None, repair: bool, out: Callable[[str], None] = print) -> int:
    """Print every entry of `store` (or of one stage's folder) and, with `repair`, repair each
    finding; the exit code: 1 when something is wrong and was not repaired, else 0.
    StoreNotWritable, before any repair, when one of them could not be written."""
    entries = store.survey(stage)
    command = f"gristmill verify{f' --stage {stage}' if stage else ''} --repair"
    findings = [entry for entry in entries if is_finding(entry)]
    for entry in entries:
        if (line := describe(entry, store, command)) is not None:
            out(line)
    if repair:
        repairs = [step for entry in findings for step in _repairs(store, entry)]
        _check_writable(repairs)  # all or nothing: a store is not left half repaired
        for action, path in repairs:
            if (line := _apply(store, action, path)) is not None:
                out(line)
    out(summary(entries, store) + ("; repaired: the next run recomputes what was set aside"
                                   if findings and repair else ""))
    if findings and not repair:
        out(f"{len(findings)} finding(s); `{command}` sets each damaged output (and what was computed "
            "from it) and each unknown entry aside, and seals manifests of before sealing whose files "
            "check out; the next run recomputes what was set aside")
        return 1
    return 0


def is_finding(entry: Entry) -> bool:
    """A committed output that does not count, or an entry the store's layout does not name."""
    return entry.kind == "unknown" or (entry.kind == "committed" and bool(entry.problems))


def describe(entry: Entry, store: ArtifactStore, command: str) -> str | None:
    """The line naming one entry (None for the kinds only counted)."""
    where = entry.path.relative_to(store.root).as_posix()
    if entry.kind == "committed" and not entry.problems:
        return f"ok        {entry.path.name}"
    if entry.kind == "committed":
        files = ", ".join(f"{rel} ({why})" for rel, why in entry.problems.items())
        return f"DAMAGED {entry.path.name}: {files} [repair: {command}]"
    if entry.kind == "unknown":
        return f"UNKNOWN {where}: not written by gristmill [repair: {command} sets it aside]"
    return None if entry.kind in COUNTED else f"{entry.kind:<9} {where}: {MEANING[entry.kind]}"


def summary(entries: list[Entry], store: ArtifactStore) -> str:
    """The last line: how many outputs were checked and how many entries of each kind were found."""
    kinds = Counter(entry.kind for entry in entries)
    damaged = sum(1 for entry in entries if entry.kind == "committed" and entry.problems)
    others = ", ".join(f"{kinds[kind]} {label}" for kind, label in COUNT_OF.items() if kinds[kind])
    return (f"verified {kinds['committed']} artifact(s) under {store.root}: {damaged} damaged, "
            f"{kinds['unknown']} unknown" + (f"; {others}" if others else ""))


def _repairs(store: ArtifactStore, entry: Entry) -> list[tuple[str, Path]]:
    """What repairing a finding does: seal an old manifest whose files check out; else set the
    entry aside, with what depends on it."""
    if entry.kind == "committed" and entry.problems == {MANIFEST: UNSEALED}:
        return [(SEAL, entry.path)]
    dependents = store.dependents(entry.stage, entry.key) if entry.kind == "committed" else []
    return [(SET_ASIDE, path) for _, _, path in [(entry.stage, entry.key, entry.path), *dependents]]


def _check_writable(repairs: list[tuple[str, Path]]) -> None:
    """StoreNotWritable naming the first folder a repair writes in that cannot be written: an
    output's own to seal its manifest, its parent to move it aside."""
    for folder in sorted({path if action == SEAL else path.parent for action, path in repairs}):
        if problem := env.unwritable(folder):
            raise StoreNotWritable(f"--repair writes in the artifact store, and {problem}: nothing was "
                                   "set aside or sealed")


def _apply(store: ArtifactStore, action: str, path: Path) -> str | None:
    """Do one repair; the line saying what was done (None: set aside already, as a dependent of
    an earlier finding)."""
    if action == SEAL:
        store.reseal(path)
        return f"  sealed {path.name}: its files are the bytes its manifest records"
    if path.exists() or path.is_symlink():
        return f"  set aside {path.name} -> {store.set_aside(path).name}"
    return None
