"""Content-addressed artifact store: the only code that knows the on-disk layout (with
infra/store_entries.py, which names each entry of it, and infra/store_records.py).

    <root>/<stage>/<stage>-<key>/            a committed output; manifest.json is written last
    <root>/<stage>/<stage>-<key>.partial/    work in progress, kept across crashes so a stage resumes
    <root>/<stage>/<stage>-<key>.lock        an flock, so two runs of one key never both compute
    <root>/<stage>/<stage>-<key>.gates.jsonl decisions on the output's data gates (flows/gates.py),
                                             beside it: the output itself never changes
    <root>/<stage>/<stage>-<key>.corrupt-<time>/  set aside (`set_aside`): kept to look at, never reused
    <root>/<stage>/.<stage>-<key>.download-*/      being downloaded from the remote store
    <root>/corpus/versions.jsonl             the corpus versions published by data refreshes

With `GRISTMILL_STORE=s3://bucket/prefix` the committed outputs live in the bucket and <root> is
this machine's copy of them (infra/remote_store.py): a commit uploads the output, its manifest
last, before the local rename; an output absent here is downloaded when a run asks for it, its
files through this node's object cache (core/cache.py: verified, hard-linked, so stored once) and
the output counted in the cache's bound, so the least recently used downloads are deleted again
(a later run downloads them anew); a lease object, beside the flock, makes two runs on any
machines compute a key once.

A key is a hash of the stage name and version, its hashed config, the keys of its upstream
artifacts and a fingerprint of any external inputs. An output counts as complete only when it
passes infra/integrity.py's checks: its sealed manifest names its own stage and key and lists the
files its stage's contract requires (`contracts`: stage -> glob patterns), every listed file is
there with the recorded size, and the recorded sha256 for the small files (configs, tokenizers,
model configs) or, with `verify_on_reuse="sha256"`, for every file, and nothing unlisted is beside
them; a directory that merely exists (e.g. a crash before the manifest) is never taken as
complete. `survey` accounts for every entry under the store by its name (an output, a partial one,
one set aside, a lock... or unknown) and re-hashes every committed file: `gristmill verify`.
`set_aside` moves a damaged output (and what was computed from it) out of the way, so the next
run recomputes it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gristmill.core import object_store
from gristmill.core.cache import ObjectCache
from gristmill.core.faults import fault_point
from gristmill.core.files import describe_files
from gristmill.core.stage import Manifest
from gristmill.infra import env
from gristmill.infra.integrity import (
    MANIFEST,
    SEAL,
    SMALL_FILE_BYTES,
    VerifyMode,
    canonical_json,
    checked_manifest,
    file_problems,
    file_records,
    manifest_problems,
    manifest_text,
    read_manifest,
    remove_empty_folders,
    seal_of,
    unlisted,
)
from gristmill.infra.interrupt import stop_if_interrupted
from gristmill.infra.remote_store import RemoteStore
from gristmill.infra.store_entries import ASIDE, IN_CORPUS, IN_STAGE, KEY_LENGTH, Entry, EntryKind, kind_of, listing
from gristmill.infra.store_records import CORPUS, StoreRecords
from gristmill.model.checkpoint import StoreMapping

__all__ = ["CONFIG", "CORPUS", "MANIFEST", "SMALL_FILE_BYTES", "ArtifactStore", "Contracts", "Damage", "Entry",
           "VerifyMode", "canonical_json", "home_store", "stage_key"]

STORE_ENV = "GRISTMILL_STORE"  # where committed outputs live: a local path or s3://bucket/prefix
CONFIG = "config.json"
# stage -> glob patterns of the files every output of it lists (what its downstream stages read)
Contracts = Mapping[str, Sequence[str]]

log = logging.getLogger("gristmill.store")


def stage_key(stage: str, version: int, config: dict[str, Any], upstream: dict[str, str],
              inputs_fingerprint: str | None = None) -> str:
    """The artifact key: stable across processes, sensitive to anything that changes outputs."""
    payload = {"stage": stage, "version": version, "config": config, "upstream": upstream,
               "inputs": inputs_fingerprint}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:KEY_LENGTH]


@dataclass(frozen=True)
class Damage:
    """A committed output whose files differ from its manifest: rel path -> what is wrong."""
    stage: str
    key: str
    path: Path
    files: dict[str, str]


class ArtifactStore(StoreRecords):
    """Materializes stage outputs under `root`, reusing any complete output with the same key;
    `verify_on_reuse` says how a reused output's files are checked: "size" (the small ones
    hashed too) or "sha256" (every byte). With `remote`, `root` is this machine's copy of it.
    With `contracts`, the store's stages are those it names, and each output must list the files
    its stage's patterns match; without, any folder under `root` is a stage's."""

    def __init__(self, root: Path, verify_on_reuse: VerifyMode = "size", remote: RemoteStore | None = None,
                 contracts: Contracts | None = None):
        self.root = Path(root)
        self.verify_on_reuse: VerifyMode = verify_on_reuse
        self.remote = remote
        self.contracts = contracts

    def final_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / f"{stage}-{key}"

    def partial_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / f"{stage}-{key}.partial"

    def load(self, stage: str, key: str) -> Manifest | None:
        """The committed manifest for (stage, key), or None when the output is absent or incomplete;
        one committed only on the remote store is downloaded first, one only here uploaded (the
        bucket holds every output a run uses, so workers can read it there)."""
        manifest = self._complete(self.final_dir(stage, key), stage, key)
        if self.remote is None:
            return manifest
        if manifest is None:
            return self._download(self.remote, stage, key)
        ObjectCache().touch_tree(manifest.path)  # a downloaded output, used: the last to be evicted
        if self.remote.manifest(stage, key) is None:  # committed here before the store had a bucket
            self.remote.upload(stage, key, manifest.path, list(manifest.files))
        return manifest

    @property
    def store_mapping(self) -> StoreMapping | None:
        """This store's local copy and its bucket, for the training stages computed from it: their
        checkpoints go beside their partial folder's place there (model/checkpoint.py); None
        without a bucket (they stay in the partial folder)."""
        return None if self.remote is None else StoreMapping(self.root, self.remote.url)

    def remote_location(self, local: Path) -> str:
        """The URL on the remote store of a path under `root` (a partial folder's working files)."""
        if self.remote is None:
            raise ValueError(f"the artifact store at {self.root} has no remote store")
        return f"{self.remote.url}/{Path(local).relative_to(self.root).as_posix()}"

    def has(self, stage: str, key: str) -> bool:
        """Whether (stage, key) is committed, here or on the remote store (nothing is downloaded)."""
        return self._complete(self.final_dir(stage, key), stage, key) is not None or \
            (self.remote is not None and self.remote.manifest(stage, key) is not None)

    def _download(self, remote: RemoteStore, stage: str, key: str) -> Manifest | None:
        """The committed (stage, key) of `remote` (this store's), copied into a temporary directory
        beside its place and renamed into it; None when the remote has none."""
        record = remote.manifest(stage, key)
        if record is None or record.get("key") != key:
            return None
        final = self.final_dir(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        fetching = Path(tempfile.mkdtemp(prefix=f".{final.name}.download-", dir=final.parent))
        try:
            remote.download(stage, key, [], fetching)  # the manifest; its files through the cache:
            ObjectCache().fill(fetching, {rel: (f"{remote.url_of(stage, key)}/{rel}", info["bytes"], info["sha256"])
                                          for rel, info in file_records(record).items()})  # a path outside: left out
            if self._complete(fetching, stage, key) is None:
                raise OSError(f"{remote.url_of(stage, key)} differs from its manifest")
            if final.exists() and self._complete(final, stage, key) is None:
                shutil.rmtree(final)  # an incomplete leftover
            with contextlib.suppress(OSError):  # a concurrent download may have put it there first
                os.replace(fetching, final)
            ObjectCache().keep_tree(final)  # within the cache's bound, evicted when least used
        finally:
            shutil.rmtree(fetching, ignore_errors=True)
        log.info("%s-%s: downloaded from %s", stage, key, remote.url_of(stage, key))
        return self._complete(final, stage, key)

    def _complete(self, directory: Path, stage: str, key: str) -> Manifest | None:
        """The manifest in `directory` when the output there passes the checks of reuse (the
        module's docstring); else None, with a warning naming what failed unless it has no
        manifest at all (not computed yet, or stopped before its commit)."""
        if not (directory / MANIFEST).exists():
            return None
        record, problems = self._check(directory, stage, key, self.verify_on_reuse)
        if problems or record is None:  # no record comes with the problem that says why
            found = ", ".join(f"{rel} ({why})" for rel, why in problems.items())
            log.warning("%s-%s: %s; not reused (`gristmill verify` checks the whole store)", stage, key, found)
            return None
        return Manifest.from_json({k: v for k, v in record.items() if k != SEAL}, self.final_dir(stage, key))

    def _check(self, directory: Path, stage: str, key: str,
               mode: VerifyMode) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """(the manifest in `directory`, rel path -> what keeps it from counting as (stage, key))."""
        record, found = checked_manifest(directory)
        if record is None:
            return None, {MANIFEST: found[0]}
        found += manifest_problems(record, stage, key, [CONFIG, *(self.contracts or {}).get(stage, ())])
        problems = {MANIFEST: "; ".join(found)} if found else {}
        problems |= file_problems(directory, file_records(record), mode)
        if isinstance(record.get("files"), dict):
            problems |= unlisted(directory, list(record["files"]))
        return record, problems

    def survey(self, stage: str | None = None) -> list[Entry]:
        """Every entry under the store (or in one stage's folder) named for what it is by the layout
        above, anything else "unknown"; each committed output checked as `verify` checks it."""
        if stage is not None:
            return self._survey_stage(self.root / stage)
        entries: list[Entry] = []
        for top in listing(self.root):
            kind = self._root_kind(top)
            if kind == "stage":
                entries += self._survey_stage(top)
            elif kind == "corpus":
                entries += [Entry(kind_of(path, IN_CORPUS, CORPUS)[0], path) for path in listing(top)]
            else:
                entries.append(Entry(kind, top))
        return entries

    def _survey_stage(self, folder: Path) -> list[Entry]:
        entries = []
        for path in listing(folder):
            kind, key = kind_of(path, IN_STAGE, folder.name)
            problems = self._check(path, folder.name, key, "sha256")[1] if kind == "committed" else {}
            entries.append(Entry(kind, path, folder.name, key, problems))
        return entries

    def _root_kind(self, path: Path) -> EntryKind | Literal["stage"]:
        """What a name right under `root` is: a stage's folder, the corpus versions, set aside or unknown."""
        if re.fullmatch(ASIDE, path.name):
            return "set aside"
        if not path.is_dir() or path.is_symlink():
            return "unknown"
        if path.name == CORPUS:
            return "corpus"
        return "stage" if self.contracts is None or path.name in self.contracts else "unknown"

    def committed(self, stage: str | None = None) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, directory) of every folder named as a committed output, of one stage or all,
        whatever its contents (`verify` says whether it counts)."""
        folders = [self.root / stage] if stage else [p for p in listing(self.root) if self._root_kind(p) == "stage"]
        for folder in folders:
            for path in listing(folder):
                if (found := kind_of(path, IN_STAGE, folder.name))[0] == "committed":
                    yield folder.name, found[1], path

    def manifests(self, stage: str | None = None) -> Iterator[dict[str, Any]]:
        """The parsed manifest of every committed output (of `stage`, or all); unreadable ones are
        left out (`verify` reports them)."""
        for _, _, directory in self.committed(stage):
            if (record := read_manifest(directory)[0]) is not None:
                yield record

    def verify(self, stage: str | None = None) -> list[Damage]:
        """Every committed output (of `stage`, or all) that does not count: its manifest missing,
        unreadable, of another shape, stage or key, its seal broken, or its files not the bytes it
        records (missing, another size or sha256, unreadable, unlisted ones beside them)."""
        return [Damage(entry.stage, entry.key, entry.path, entry.problems) for entry in self.survey(stage)
                if entry.kind == "committed" and entry.problems]

    def dependents(self, stage: str, key: str) -> list[tuple[str, str, Path]]:
        """The committed outputs computed from (stage, key), directly or through others."""
        found: list[tuple[str, str, Path]] = []
        frontier = {(stage, key)}
        while frontier:
            nxt = set()
            for name, k, directory in self.committed():
                upstream = (read_manifest(directory)[0] or {}).get("upstream", {})
                upstream = upstream if isinstance(upstream, dict) else {}
                if any(upstream.get(s) == uk for s, uk in frontier) and (name, k, directory) not in found:
                    found.append((name, k, directory))
                    nxt.add((name, k))
            frontier = nxt
        return found

    def set_aside(self, path: Path) -> Path:
        """Move a committed output (or an unknown entry) to `<path>.corrupt-<time>`: kept for
        inspection, never reused."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside, n = path.with_name(f"{path.name}.corrupt-{stamp}"), 1
        while os.path.lexists(aside):  # set aside twice within a second
            aside, n = path.with_name(f"{path.name}.corrupt-{stamp}-{n}"), n + 1
        os.replace(path, aside)
        return aside

    def reseal(self, directory: Path) -> None:
        """Seal the manifest of an output committed before manifests were sealed; call it only once
        `verify` found nothing else wrong with the output (its files are the bytes it records)."""
        record = _manifest_of(directory)
        tmp = directory / (MANIFEST + ".tmp")
        tmp.write_text(manifest_text({**record, SEAL: seal_of(record)}))
        os.replace(tmp, directory / MANIFEST)

    @contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        """Exclusive lock on one key. flock is released by the OS if the holder dies (kill -9)."""
        path = self.root / stage / f"{stage}-{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("%s-%s is being computed by another run; waiting for it", stage, key)
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def materialize(self, stage: str, key: str,
                    compute: Callable[[Path], dict[str, Any]]) -> tuple[Manifest, bool]:
        """Return (manifest, reused). When no complete output exists, `compute(partial_dir)` fills
        the partial dir and returns the manifest fields (config, upstream, stats, meta); the manifest
        is then written last and the directory renamed into place atomically."""
        if (manifest := self.load(stage, key)) is not None:
            return manifest, True
        with self.lock(stage, key), self._remote_lease(stage, key):
            if (manifest := self.load(stage, key)) is not None:  # finished while we waited
                return manifest, True
            partial = self.partial_dir(stage, key)
            if self._complete(partial, stage, key) is not None:  # killed inside the commit window
                log.info("%s-%s: finishing the commit an earlier run was stopped in", stage, key)
                return self._publish(stage, key, partial), False
            if partial.exists():
                log.info("%s-%s: resuming from the partial output left by an earlier run", stage, key)
            partial.mkdir(parents=True, exist_ok=True)
            started, retried = time.time(), object_store.retries()
            fields = compute(partial)
            fields.setdefault("meta", {})["seconds"] = round(time.time() - started, 3)
            # what object stores cost the stage: this process's retries while it computed, and those
            # of its Ray workers or launched ranks, which `compute` reports
            stats = fields.setdefault("stats", {})
            total = stats.pop("store_retries", 0) + object_store.retries() - retried
            if self.remote is not None or total:
                stats["store_retries"] = total
            return self.commit(stage, key, partial, fields), False

    def _remote_lease(self, stage: str, key: str) -> contextlib.AbstractContextManager[None]:
        if (remote := self.remote) is None:
            return contextlib.nullcontext()
        return remote.lease(stage, key, committed=lambda: remote.manifest(stage, key) is not None)

    def commit(self, stage: str, key: str, partial: Path, fields: dict[str, Any]) -> Manifest:
        """Write the manifest last into `partial` and publish it (under `lock`)."""
        (partial / CONFIG).write_text(json.dumps(fields["config"], indent=2, sort_keys=True))
        tmp = partial / (MANIFEST + ".tmp")
        tmp.unlink(missing_ok=True)  # left by a run stopped while it committed
        remove_empty_folders(partial)  # the manifest lists files: a folder is there for its files
        # every file but the manifest itself (a stage's own file of that name, deeper down, counts)
        files = {rel: info for rel, info in describe_files(partial, exclude="").items() if rel != MANIFEST}
        record = Manifest(stage=stage, key=key, path=self.final_dir(stage, key), files=files, **fields).to_json()
        tmp.write_text(manifest_text({**record, SEAL: seal_of(record)}))
        stop_if_interrupted(f"committing {stage}-{key}")  # the output stays partial, to resume from
        os.replace(tmp, partial / MANIFEST)
        fault_point(f"commit:{stage}")
        return self._publish(stage, key, partial)

    def _publish(self, stage: str, key: str, partial: Path) -> Manifest:
        """Upload a complete partial output to the remote store, if any, then rename it into place."""
        if self.remote is not None:
            self.remote.upload(stage, key, partial, list(_manifest_of(partial)["files"]))
        final = self.final_dir(stage, key)
        if final.is_dir() and not final.is_symlink():  # a leftover that does not count: replace it
            shutil.rmtree(final)
        elif os.path.lexists(final):  # a file or a link where the output goes
            final.unlink()
        os.replace(partial, final)
        if (manifest := self.load(stage, key)) is None:
            raise OSError(f"{final}: the output just committed fails the checks of reuse (see the warning above)")
        return manifest


def _manifest_of(directory: Path) -> dict[str, Any]:
    """The parsed manifest of an output this store wrote; OSError saying why it cannot be read."""
    record, why = read_manifest(directory)
    if record is None:
        raise OSError(f"{directory}: {why}")
    return record


def home_store(home: Path, verify_on_reuse: VerifyMode = "size", contracts: Contracts | None = None) -> ArtifactStore:
    """The store of GRISTMILL_HOME `home`: `$GRISTMILL_STORE` when that is a local path, else
    home/artifacts, which with an s3:// `$GRISTMILL_STORE` is this machine's copy of the bucket's."""
    url = os.environ.get(STORE_ENV, "")
    if "://" not in url:
        return ArtifactStore(Path(url) if url else env.artifacts_root(home), verify_on_reuse, contracts=contracts)
    return ArtifactStore(env.artifacts_root(home), verify_on_reuse, remote=RemoteStore(url), contracts=contracts)
