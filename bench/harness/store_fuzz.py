"""Store fuzzing at store level: random damage to a copy of a finished run's artifact store
(bench/harness/store_damage.py's KINDS, one trial each), and whether `gristmill verify` names it and reuse
refuses what it touched, and nothing else. `python -m bench store-fuzz` runs these trials (and
pipeline runs over the damaged stores); tests/infra/test_store_fuzz.py runs them in CI."""
from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.store_damage import KINDS, Harm, Output, manifest_of
from gristmill.flows.stages import contracts
from gristmill.infra.artifacts import ArtifactStore, Entry
from gristmill.infra.integrity import VerifyMode


@dataclass
class Trial:
    """One trial's damage and what the checks made of it."""
    kind: str
    what: str
    named: bool
    refused_sha256: bool
    refused_size: bool
    unhashed: bool
    spurious: list[str] = field(default_factory=list)
    identical: bool | None = None  # None: no run after it

    @property
    def detected(self) -> bool:
        """Named by verify, refused for reuse (by size too, unless only hashing can see it), and
        nothing else named or refused."""
        return self.named and self.refused_sha256 and (self.refused_size or self.unhashed) and not self.spurious


def outputs_of(store: ArtifactStore) -> list[Output]:
    """The committed outputs of a store that verifies (SystemExit naming what does not)."""
    if bad := [f"{entry.path}: {entry.problems or entry.kind}" for entry in store.survey()
               if entry.kind == "unknown" or entry.problems]:
        raise SystemExit("store-fuzz: the source store does not verify:\n  " + "\n  ".join(bad))
    return [Output(found, manifest_of(found[2])["files"]) for found in store.committed()]


def check(store: ArtifactStore, harm: Harm, outputs: list[Output]) -> tuple[bool, bool, bool, list[str]]:
    """(verify named it, reuse refused it by sha256, by size, what else was reported or refused);
    an exception, in verify or in reuse, counts as a miss."""
    try:
        findings = {entry.path: entry for entry in store.survey() if entry.kind == "unknown" or entry.problems}
    except Exception as error:  # a crash is what the fuzzer is for
        return False, _refused(store, harm, "sha256"), _refused(store, harm, "size"), [f"verify raised {error!r}"]
    named = all(path in findings and (rel is None or rel in findings[path].problems) for path, rel in harm.named)
    spurious = [f"{path.relative_to(store.root)}: {_said(entry)}" for path, entry in findings.items()
                if path not in {named_path for named_path, _ in harm.named}]
    reuse = ArtifactStore(store.root, "size", contracts=store.contracts)
    spurious += [f"{out.stage}-{out.key} refused" for out in outputs  # those it left alone (or moved whole)
                 if (out.stage, out.key) not in harm.refused and out.path.exists()
                 and reuse.load(out.stage, out.key) is None]
    return named, _refused(store, harm, "sha256"), _refused(store, harm, "size"), spurious


def _refused(store: ArtifactStore, harm: Harm, mode: VerifyMode) -> bool:
    """Whether reuse with `verify_on_reuse=mode` refuses every output the damage touched."""
    reuse = ArtifactStore(store.root, mode, contracts=store.contracts)
    try:
        return all(reuse.load(stage, key) is None for stage, key in harm.refused)
    except Exception:  # reuse must refuse, not crash
        return False


def _said(entry: Entry) -> str:
    return ", ".join(f"{rel} ({why})" for rel, why in entry.problems.items()) or entry.kind


def restore(root: Path, source: Path, names: set[str]) -> None:
    """Put the top-level entries `names` of the store at `root` back as they are in `source`."""
    for name in names:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            for folder, dirs, files in os.walk(path):  # a folder or file damaged to mode 000
                for entry in [*dirs, *files]:
                    if not (Path(folder) / entry).is_symlink():
                        (Path(folder) / entry).chmod(0o755)
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        if (source / name).exists():
            shutil.copytree(source / name, path, symlinks=True)


def run_trials(source: Path, work: Path, trials: int, seed: int,
               after: Callable[[int, Path], bool | None] | None = None) -> list[Trial]:
    """`trials` trials on a copy of the store at `source` made in `work`; `after(i, root)`, called
    with the damaged store, may return whether a run over it ended with the undamaged bytes."""
    root = work / "store"
    shutil.copytree(source, root, symlinks=True)
    store = ArtifactStore(root, contracts=contracts())
    outputs = outputs_of(store)
    results = []
    for i in range(trials):
        rng = random.Random(f"{seed}:{i}")
        kind, chosen = list(KINDS)[i % len(KINDS)], rng.choice(outputs)
        harm = KINDS[kind](store, chosen, rng)
        named, by_sha256, by_size, spurious = check(store, harm, outputs)
        results.append(Trial(kind, f"{chosen.stage}: {harm.what}", named, by_sha256, by_size, harm.unhashed,
                             spurious, after(i, root) if after else None))
        restore(root, source, harm.touched)
    if left := [entry.path for entry in store.survey() if entry.kind == "unknown" or entry.problems]:
        raise RuntimeError(f"store-fuzz: the store was not restored: {left}")
    return results
