"""The docs cannot drift: the configuration reference is the config models' own, every link and
every file path the README and docs/ name exists, and the site builds with `mkdocs build --strict`.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import ClassVar, Literal

import pytest
from markdown.extensions.toc import slugify
from pydantic import BaseModel, Field

from flows.config import PipelineConfig
from flows.config_reference import reference_markdown, rows, type_name

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
# A repository path as code in the docs writes it (`infra/schemas.py`, `flows/pipeline.py:pipeline`).
# Globs and placeholders (`docs/part-*.jsonl.gz`, `infra/accelerate/<name>.yaml`) are left out.
TOP_DIRS = "bench|configs|core|docs|flows|infra|model|tasks|tests"
REPO_PATH = re.compile(rf"(?<![\w./$-])((?:{TOP_DIRS})/[\w./-]*+)(?![*<{{])")


def test_configuration_reference_matches_the_config_models():
    checked_in = (DOCS / "configuration.md").read_text()
    assert checked_in == reference_markdown(), (
        "docs/configuration.md is stale: run `python -m flows.config_reference > docs/configuration.md`")


def _flat_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in tree.items():
        keys.add(prefix + name)
        if isinstance(value, dict):
            keys |= _flat_keys(value, f"{prefix}{name}.")
    return keys


def test_the_reference_lists_every_key_of_the_default_config():
    listed = {row.key for row in rows(PipelineConfig)}
    dumped = _flat_keys(PipelineConfig().model_dump())
    missing = {key for key in dumped if not any(key == k or key.startswith(k + ".") for k in listed)}
    assert not missing
    assert all(row.description for row in rows(PipelineConfig)), "a config field without a description"


class _Inner(BaseModel):
    rate: float = Field(0.5, ge=0, lt=1, description="A share.")


class _Outer(BaseModel):
    unhashed_fields: ClassVar[frozenset[str]] = frozenset({"workers"})
    mode: Literal["a", "b"] = Field("a", description="Which.")
    workers: int = Field(2, gt=0, description="How many.")
    inner: _Inner = Field(default_factory=_Inner, description="A section.")
    extra: _Inner | None = Field(None, description="An optional section.")
    names: list[str] = Field(default_factory=lambda: ["x"], description="Some <names>.")


def test_rows_walk_sections_with_types_bounds_defaults_and_operational_keys():
    found = {row.key: row for row in rows(_Outer)}
    assert list(found) == ["mode", "workers", "inner", "inner.rate", "extra", "extra.rate", "names"]
    assert (found["mode"].type, found["mode"].default) == ('"a" / "b"', '`"a"`')
    assert (found["workers"].type, found["workers"].description) == ("int (> 0)", "*Operational.* How many.")
    assert (found["inner.rate"].type, found["inner.rate"].default) == ("float (≥ 0, < 1)", "`0.5`")
    assert (found["extra"].type, found["extra"].default) == ("section or null", "`null`")
    assert found["names"].default == '`["x"]`'
    assert type_name(dict[str, int | None]) == "map of str to int or null"
    page = reference_markdown(_Outer)
    assert "Some &lt;names>." in page and "\n## inner\n" in page and "\n## extra\n" in page


def _headings(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slugify(LINK.sub(r"\1", h).replace("`", ""), "-") for h in HEADING.findall(text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        missing_anchor = anchor and resolved.suffix == ".md" and anchor not in _headings(resolved)
        if not resolved.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_named_exists(page: Path):
    text = page.read_text()
    code = FENCE.findall(text) + re.findall(r"`[^`\n]+`", FENCE.sub("", text))  # not prose: "docs/s"
    named = {m.rstrip(".:") for m in REPO_PATH.findall("\n".join(code))}
    missing = sorted(p for p in named if not (REPO / p.split(":")[0]).exists())
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_the_readme_fits_on_a_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    assert max(len(line) for line in lines) <= 200


def test_the_site_builds_strictly(tmp_path):
    # Not -q: quiet mode hides the warnings --strict counts, and the build passes whatever is broken.
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
               "-d", str(tmp_path / "site")]
    built = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
