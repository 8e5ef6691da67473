"""Content-addressed artifact store: the only code that knows the on-disk layout.

    <root>/<stage>/<stage>-<key>/            a committed output; manifest.json is written last
    <root>/<stage>/<stage>-<key>.partial/    work in progress, kept across crashes so a stage resumes
    <root>/<stage>/<stage>-<key>.lock        an flock, so two runs of one key never both compute
    <root>/<stage>/<stage>-<key>.gates.jsonl decisions on the output's data gates (flows/gates.py),
                                             beside it: the output itself never changes
    <root>/corpus/versions.jsonl             the corpus versions published by data refreshes

With `GRISTMILL_STORE=s3://bucket/prefix` the committed outputs live in the bucket and <root> is
this machine's copy of them (infra/remote_store.py): a commit uploads the output, its manifest
last, before the local rename; an output absent here is downloaded when a run asks for it; a lease
object, beside the flock, makes two runs on any machines compute a key once.

A key is a hash of the stage name and version, its hashed config, the keys of its upstream
artifacts and a fingerprint of any external inputs. An output counts as complete only when its
manifest exists, parses, names the same key and every file it lists has the recorded size, and
the recorded sha256 for the small files (configs, tokenizers, model configs) or, with
`verify_on_reuse="sha256"`, for every file; a directory that merely exists (e.g. a crash before
the manifest) is never taken as complete. `verify` re-hashes every committed file against its
manifest, and `set_aside` moves a damaged output (and what was computed from it) out of the way,
so the next run recomputes it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.faults import fault_point
from core.files import describe_files, file_digest
from core.stage import Manifest
from infra import env
from infra.remote_store import RemoteStore

MANIFEST = "manifest.json"
STORE_ENV = "GRISTMILL_STORE"  # where committed outputs live: a local path or s3://bucket/prefix
CONFIG = "config.json"
KEY_LENGTH = 12  # hex chars of sha256: 48 bits, ample for one project's artifacts
CORPUS = "corpus"  # not a stage: the chain of corpus versions over collect artifacts

log = logging.getLogger("gristmill.store")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def stage_key(stage: str, version: int, config: dict[str, Any], upstream: dict[str, str],
              inputs_fingerprint: str | None = None) -> str:
    """The artifact key: stable across processes, sensitive to anything that changes outputs."""
    payload = {"stage": stage, "version": version, "config": config, "upstream": upstream,
               "inputs": inputs_fingerprint}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:KEY_LENGTH]


SMALL_FILE_BYTES = 1 << 20  # files this small are hashed whenever an output is reused
VerifyMode = Literal["size", "sha256"]


@dataclass(frozen=True)
class Damage:
    """A committed output whose files differ from its manifest: rel path -> what is wrong."""
    stage: str
    key: str
    path: Path
    files: dict[str, str]


class ArtifactStore:
    """Materializes stage outputs under `root`, reusing any complete output with the same key;
    `verify_on_reuse` says how a reused output's files are checked: "size" (the small ones
    hashed too) or "sha256" (every byte). With `remote`, `root` is this machine's copy of it."""

    def __init__(self, root: Path, verify_on_reuse: VerifyMode = "size", remote: RemoteStore | None = None):
        self.root = Path(root)
        self.verify_on_reuse = verify_on_reuse
        self.remote = remote

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
            return self._download(stage, key)
        if self.remote.manifest(stage, key) is None:  # committed here before the store had a bucket
            self.remote.upload(stage, key, manifest.path, list(manifest.files))
        return manifest

    def remote_location(self, local: Path) -> str:
        """The URL on the remote store of a path under `root` (a partial folder's working files)."""
        return f"{self.remote.url}/{Path(local).relative_to(self.root).as_posix()}"

    def has(self, stage: str, key: str) -> bool:
        """Whether (stage, key) is committed, here or on the remote store (nothing is downloaded)."""
        return self._complete(self.final_dir(stage, key), stage, key) is not None or \
            (self.remote is not None and self.remote.manifest(stage, key) is not None)

    def _download(self, stage: str, key: str) -> Manifest | None:
        """The remote's committed (stage, key), copied into a temporary directory beside its place
        and renamed into it; None when the remote has none."""
        record = self.remote.manifest(stage, key)
        if record is None or record.get("key") != key:
            return None
        final = self.final_dir(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        fetching = Path(tempfile.mkdtemp(prefix=f".{final.name}.download-", dir=final.parent))
        try:
            self.remote.download(stage, key, list(record.get("files", {})), fetching)
            if self._complete(fetching, stage, key) is None:
                raise OSError(f"{self.remote.url_of(stage, key)} differs from its manifest")
            if final.exists() and self._complete(final, stage, key) is None:
                shutil.rmtree(final)  # an incomplete leftover
            with contextlib.suppress(OSError):  # a concurrent download may have put it there first
                os.replace(fetching, final)
        finally:
            shutil.rmtree(fetching, ignore_errors=True)
        log.info("%s-%s: downloaded from %s", stage, key, self.remote.url_of(stage, key))
        return self._complete(final, stage, key)

    def _complete(self, directory: Path, stage: str, key: str) -> Manifest | None:
        """The manifest in `directory` when it names (stage, key) and every file it lists is there
        with its recorded size; else None."""
        data = _read_manifest(directory)
        if data is None or data.get("key") != key or data.get("stage") != stage:
            return None
        for rel, why in _file_problems(directory, data.get("files", {}), self.verify_on_reuse).items():
            log.warning("%s-%s: %s %s; treating the output as incomplete", stage, key, rel, why)
            return None
        return Manifest.from_json(data, self.final_dir(stage, key))

    def committed(self, stage: str | None = None) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, directory) of every output with a manifest, of one stage or all."""
        for manifest in sorted(self.root.glob(f"{stage or '*'}/*/{MANIFEST}")):
            name, _, key = manifest.parent.name.rpartition("-")
            if name == manifest.parent.parent.name and len(key) == KEY_LENGTH and key.isalnum():
                yield name, key, manifest.parent

    def manifests(self, stage: str | None = None) -> Iterator[dict[str, Any]]:
        """The parsed manifest of every committed output (of `stage`, or all); unreadable ones are
        left out (`verify` reports them)."""
        for _, _, directory in self.committed(stage):
            if (record := _read_manifest(directory)) is not None:
                yield record

    def verify(self, stage: str | None = None) -> list[Damage]:
        """Every committed output (of `stage`, or all) whose files are not the bytes its manifest
        records (missing, another size, another sha256), or whose manifest does not parse."""
        damaged = []
        for name, key, directory in self.committed(stage):
            record = _read_manifest(directory)
            problems = {MANIFEST: "unreadable"} if record is None else \
                _file_problems(directory, record.get("files", {}), "sha256")
            if problems:
                damaged.append(Damage(name, key, directory, problems))
        return damaged

    def dependents(self, stage: str, key: str) -> list[tuple[str, str, Path]]:
        """The committed outputs computed from (stage, key), directly or through others."""
        found: list[tuple[str, str, Path]] = []
        frontier = {(stage, key)}
        while frontier:
            nxt = set()
            for name, k, directory in self.committed():
                upstream = (_read_manifest(directory) or {}).get("upstream", {})
                if any(upstream.get(s) == uk for s, uk in frontier) and (name, k, directory) not in found:
                    found.append((name, k, directory))
                    nxt.add((name, k))
            frontier = nxt
        return found

    def set_aside(self, directory: Path) -> Path:
        """Move a committed output to `<dir>.corrupt-<time>`: kept for inspection, never reused."""
        aside = directory.with_name(f"{directory.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        os.replace(directory, aside)
        return aside

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
            started = time.time()
            fields = compute(partial)
            fields.setdefault("meta", {})["seconds"] = round(time.time() - started, 3)
            return self.commit(stage, key, partial, fields), False

    def _remote_lease(self, stage: str, key: str) -> contextlib.AbstractContextManager[None]:
        if self.remote is None:
            return contextlib.nullcontext()
        return self.remote.lease(stage, key, committed=lambda: self.remote.manifest(stage, key) is not None)

    def commit(self, stage: str, key: str, partial: Path, fields: dict[str, Any]) -> Manifest:
        """Write the manifest last into `partial` and publish it (under `lock`)."""
        (partial / CONFIG).write_text(json.dumps(fields["config"], indent=2, sort_keys=True))
        manifest = Manifest(stage=stage, key=key, path=self.final_dir(stage, key),
                            files=describe_files(partial, exclude=MANIFEST), **fields)
        tmp = partial / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=True))
        os.replace(tmp, partial / MANIFEST)
        fault_point(f"commit:{stage}")
        return self._publish(stage, key, partial)

    def _publish(self, stage: str, key: str, partial: Path) -> Manifest:
        """Upload a complete partial output to the remote store, if any, then rename it into place."""
        if self.remote is not None:
            self.remote.upload(stage, key, partial, list(_read_manifest(partial)["files"]))
        final = self.final_dir(stage, key)
        if final.exists():  # an incomplete leftover (no valid manifest): never reused, replace it
            shutil.rmtree(final)
        os.replace(partial, final)
        return self.load(stage, key)

    # --- data gates: a person's decisions on an output whose numbers tripped a gate (flows/gates.py) ---

    def gate_decisions(self, stage: str, key: str) -> list[dict[str, Any]]:
        """Every decision recorded on (stage, key)'s gates, oldest first."""
        path = self._gates_file(stage, key)
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def add_gate_decision(self, stage: str, key: str, record: dict[str, Any]) -> None:
        """Append one decision: one line, written with a single append."""
        path = self._gates_file(stage, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(canonical_json(record) + "\n")

    def _gates_file(self, stage: str, key: str) -> Path:
        return self.root / stage / f"{stage}-{key}.gates.jsonl"

    # --- corpus versions: collect artifacts chained by data refreshes (flows/refresh.py) ---

    def corpus_versions(self) -> list[dict[str, Any]]:
        """Every published corpus version, oldest first: {version, parent_version, collect_key,
        inputs (input -> its version stamp when collected), stats...}."""
        path = self.root / CORPUS / "versions.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def collect_dir(self, version: dict[str, Any]) -> Path:
        """The collect artifact holding one corpus version's documents and dedup index."""
        return self.final_dir("collect", version["collect_key"])

    def add_corpus_version(self, record: dict[str, Any]) -> None:
        """Publish one version (call under `lock(CORPUS, ...)`, so numbers follow each other); the
        file is replaced atomically, so a crash leaves the chain as it was before or after."""
        path = self.root / CORPUS / "versions.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(canonical_json(r) + "\n" for r in [*self.corpus_versions(), record])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(lines)
        os.replace(tmp, path)


def home_store(home: Path, verify_on_reuse: VerifyMode = "size") -> ArtifactStore:
    """The store of GRISTMILL_HOME `home`: `$GRISTMILL_STORE` when that is a local path, else
    home/artifacts, which with an s3:// `$GRISTMILL_STORE` is this machine's copy of the bucket's."""
    url = os.environ.get(STORE_ENV, "")
    if "://" not in url:
        return ArtifactStore(Path(url) if url else env.artifacts_root(home), verify_on_reuse)
    return ArtifactStore(env.artifacts_root(home), verify_on_reuse, remote=RemoteStore(url))


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _file_problems(directory: Path, files: dict[str, dict[str, Any]], mode: VerifyMode) -> dict[str, str]:
    """rel path -> what differs from the manifest's record: missing, another size, or (hashed in
    mode "sha256", and always for files up to SMALL_FILE_BYTES) another sha256."""
    problems = {}
    for rel, info in files.items():
        path = directory / rel
        if not path.is_file():
            problems[rel] = "missing"
        elif path.stat().st_size != info["bytes"]:
            problems[rel] = f"{path.stat().st_size} bytes, {info['bytes']} recorded"
        elif (mode == "sha256" or info["bytes"] <= SMALL_FILE_BYTES) and file_digest(path) != info["sha256"]:
            problems[rel] = "sha256 differs"
    return problems
