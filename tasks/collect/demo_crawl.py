"""The offline demo "crawl" (source `demo:python-docs`): documentation of installed Python packages.

Every machine that runs gristmill has real, human-written English text on disk: the long
description in each installed distribution's METADATA (its PyPI page) and the Markdown,
reStructuredText and HTML documents some packages ship. This module yields them as the readers'
`RawDoc` records (HTML through the same trafilatura path as a web crawl), in a deterministic
order: packages sorted by normalized name, then METADATA, then the package's files sorted.
URLs look like `python-package://<name>/<version>/<file>`.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from core.sources import DEMO_PREFIX
from tasks.collect.records import RawDoc, ReadEvent, Skipped

DEMO_NAME = "python-docs"
DEMO_SOURCE = DEMO_PREFIX + DEMO_NAME
HTML_SUFFIXES = (".html", ".htm")
TEXT_SUFFIXES = (".md", ".rst")
# Licence texts are legal boilerplate repeated across packages, not documentation.
_LEGAL_NAME = re.compile(r"licen[cs]e|copying|notice", re.IGNORECASE)
MAX_FILE_BYTES = 2_000_000  # larger shipped files are generated dumps, not prose


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


def _distributions(name: str | None = None) -> Iterator[importlib.metadata.Distribution]:
    if name is None:
        return iter(importlib.metadata.distributions(path=_environment_path()))
    return iter(importlib.metadata.distributions(name=name, path=_environment_path()))


def list_packages() -> list[tuple[str, str]]:
    """Sorted (name, version) of installed distributions; the first one on the path wins, as it
    does for `importlib.metadata.distribution(name)`."""
    found: dict[str, tuple[str, str]] = {}
    for dist in _distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize_name(name), (name, dist.version))
    return [found[key] for key in sorted(found)]


def installed_state() -> str:
    """What the demo crawl would read, cheaply (planning calls this on every run, so no METADATA
    is parsed): each installed distribution's metadata directory (its name carries the package's
    name and version) with the size of its METADATA, and for packages not installed into
    site-packages (a source checkout's egg-info, an editable install), whose files change without a
    new version, each documentation file's size and mtime."""
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in _distributions():  # the first one on the path wins, as in the crawl
        found.setdefault(normalize_name(dist._normalized_name), dist)
    lines = []
    for key in sorted(found):
        dist = found[key]
        home = Path(str(getattr(dist, "_path", "")))
        metadata = next((home / name for name in ("METADATA", "PKG-INFO") if (home / name).is_file()), None)
        stat = metadata.stat() if metadata else None
        installed = any(part in str(home) for part in ("site-packages", "dist-packages"))
        if installed and '"editable": true' not in (dist.read_text("direct_url.json") or ""):
            lines.append(f"{key} {home.name} {stat and stat.st_size}")  # the name holds the version
            continue
        # a source tree's metadata may change in place (a version bump keeps `name.egg-info`)
        lines.append(f"{key} {home.name} {stat and stat.st_size} {stat and stat.st_mtime_ns}")
        for file in _doc_files(dist):
            try:
                file_stat = file.locate().stat()
            except OSError:
                continue
            lines.append(f"  {file} {file_stat.st_size} {file_stat.st_mtime_ns}")
    return "\n".join(lines) + "\n"


def _description(dist: importlib.metadata.Distribution) -> str:
    """The long description: the METADATA body (Metadata 2.1+) or the older header form."""
    metadata = dist.metadata
    body = metadata.get_payload() if hasattr(metadata, "get_payload") else None
    return (body or metadata.get("Description") or "").strip()


def _doc_files(dist: importlib.metadata.Distribution) -> list:
    """Documentation files a distribution installed, sorted by their path."""
    files = []
    for file in dist.files or []:
        path = str(file)
        name = path.rsplit("/", 1)[-1]
        if (path.lower().endswith(HTML_SUFFIXES + TEXT_SUFFIXES) and ".dist-info/" not in path
                and not _LEGAL_NAME.search(name)):
            files.append(file)
    return sorted(files, key=str)


def package_records(dist: importlib.metadata.Distribution) -> Iterator[ReadEvent]:
    """The METADATA description, then the shipped documentation files, of one distribution."""
    base = f"python-package://{normalize_name(dist.metadata['Name'])}/{dist.version}"
    description = _description(dist)
    if description:
        yield RawDoc(url=f"{base}/METADATA", payload=description, is_html=False,
                     nbytes=len(description.encode()))
    else:
        yield Skipped(reason="skipped_no_description")
    for file in _doc_files(dist):
        try:
            payload = file.locate().read_bytes()
        except OSError:
            yield Skipped(reason="error_unreadable_file")
            continue
        if len(payload) > MAX_FILE_BYTES:
            yield Skipped(reason="skipped_file_too_large", nbytes=len(payload))
            continue
        is_html = str(file).lower().endswith(HTML_SUFFIXES)
        yield RawDoc(url=f"{base}/{file}", payload=payload, is_html=is_html, nbytes=len(payload),
                     charset=None if is_html else "utf-8")


def iter_records(packages: Sequence[tuple[str, str]]) -> Iterator[ReadEvent]:
    """Records of the given (name, version) packages, in the order given."""
    for name, version in packages:
        dist = next(_distributions(name), None)
        if dist is None:
            yield Skipped(reason="skipped_package_missing")
            continue
        if dist.version != version:  # changed since the work was planned: do not mix versions
            yield Skipped(reason="skipped_package_version_changed")
            continue
        yield from package_records(dist)
