"""The docs cannot drift: the configuration reference is the config models' own, every link and
every file path the README and docs/ name exists, every pointer the code, its --help and the
configs make into the docs and the repository resolves, and the site builds with
`mkdocs build --strict`.
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

from gristmill.flows.config import PipelineConfig
from gristmill.flows.config_reference import reference_markdown, rows, type_name

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
        "docs/configuration.md is stale: run `python -m gristmill.flows.config_reference > docs/configuration.md`")


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


# --- pointers from the code: --help texts, messages, docstrings, comments, config comments ------
# The code sends readers to docs pages, their sections (`docs/operations.md#data-refresh`), the
# README's sections ("README: Servers") and repository files (`infra/supervisor.py`, a symbol as
# `flows/pipeline.run_stage`, a module as `python -m gristmill.flows.launched`). Each must resolve, so a page,
# heading or file that moves fails here. The README is the front door only: a bare "README" names
# no section and fails too ("Flask's README", someone else's, is not a pointer).
CODE_DIRS = ("core", "model", "tasks", "infra", "flows")
CONFIG_FILES = [*sorted((REPO / "configs").glob("*.yaml")), *sorted((REPO / "infra").rglob("*.yaml")),
                REPO / "pyproject.toml", REPO / "prefect.yaml"]
ANCHOR = re.compile(r"((?:docs/[\w-]+|README)\.md)#([\w-]+)")
README = re.compile(r"(?<!'s )\bREADME\b(?!\.md)")
# What follows "README" when it names a section: "'s X section", ": X", ", X", ' "X"'.
README_SECTION = re.compile(r"""(?:'s|:|,)?\s*(?:"([A-Z][^"\n]*)"  # quoted: up to the closing quote
                                |([A-Z][^"()\n.;,]*?)(?:\s+section)?\s*(?=[)".;,\n]))""", re.VERBOSE)
MODULE = re.compile(rf"\s-m\s+((?:{TOP_DIRS})(?:\.\w+)*)")
FILE_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".sh", ".cfg", ".lst", ".html"}


def _readme_titles() -> set[str]:
    text = FENCE.sub("", (REPO / "README.md").read_text())
    return {LINK.sub(r"\1", h).replace("`", "").lower() for h in HEADING.findall(text)}


def _names_a_readme_section(name: str, titles: set[str]) -> bool:
    name = name.strip().lower()
    return any(title == name or title.startswith(name + ":") for title in titles)


def _path_problem(path: str) -> str | None:
    """Why a repository path named in the code does not resolve (None: it does). `dir/module.name`
    names a symbol of dir/module.py; a name with neither a file suffix nor a trailing slash is
    prose ("docs/tokens"), not a path."""
    if (REPO / path).exists():
        return None
    module, dot, symbol = path.rpartition(".")
    if dot and "." + symbol not in FILE_SUFFIXES and (REPO / f"{module}.py").is_file():
        source = (REPO / f"{module}.py").read_text()
        name = re.escape(symbol)
        defined = re.search(rf"^\s*(?:(?:async\s+)?def|class)\s+{name}\b|^{name}\s*[:=]", source, re.MULTILINE)
        return None if defined else f"{path}: {module}.py defines no {symbol}"
    if Path(path).suffix in FILE_SUFFIXES or path.endswith("/"):
        return f"{path}: no such file"
    return None


def broken_pointers(text: str, *, code: bool = False) -> list[str]:
    """`line: problem` for every pointer in `text` that does not resolve. `code`: Python source,
    where a string that is just a path ("model/config.json") is a value in an artifact, not a pointer."""
    readme_titles = _readme_titles()
    found: list[tuple[int, str]] = []
    for match in REPO_PATH.finditer(text):
        path = match.group(1).rstrip(".:")
        quote = text[match.start() - 1:match.start()]
        if code and quote in ("'", '"') and text.startswith(quote, match.start() + len(path)):
            continue
        if text.startswith("%", match.end()):  # a format: docs/part-%05d.jsonl.gz
            continue
        if problem := _path_problem(path):
            found.append((match.start(), problem))
    for match in ANCHOR.finditer(text):
        page, anchor = REPO / match.group(1), match.group(2)
        if page.is_file() and anchor not in _headings(page):
            found.append((match.start(), f"{match.group(0)}: {match.group(1)} has no heading #{anchor}"))
    for match in README.finditer(text):
        named = README_SECTION.match(text, match.end())
        section = named and (named.group(1) or named.group(2))
        if not section:
            found.append((match.start(), "README named without a section: name the section or the docs page"))
        elif not _names_a_readme_section(section, readme_titles):
            found.append((match.start(), f"README section {section!r}: no such heading in README.md"))
    for match in MODULE.finditer(text):
        module = REPO / match.group(1).replace(".", "/")
        if not (module.with_suffix(".py").is_file() or (module / "__init__.py").is_file()):
            found.append((match.start(), f"-m {match.group(1)}: no such module"))
    return [f"{text.count(chr(10), 0, at) + 1}: {problem}" for at, problem in sorted(found)]


def test_the_pointer_check_finds_what_moved():
    text = ("(docs/operations.md#no-such-heading) (README: Gone away) see the README.\n"
            "(README's Servers section) infra/nowhere.py, flows/pipeline.no_such_function,\n"
            "python -m flows.no_such_module; fine: docs/operations.md#data-gates, README.md, README, Two commands.\n"
            "docs/part-%05d.jsonl.gz and docs/tokens, flows/pipeline.run_stage\n")
    assert broken_pointers(text) == [
        "1: docs/operations.md#no-such-heading: docs/operations.md has no heading #no-such-heading",
        "1: README section 'Gone away': no such heading in README.md",
        "1: README named without a section: name the section or the docs page",
        "2: README section 'Servers': no such heading in README.md",
        "2: infra/nowhere.py: no such file",
        "2: flows/pipeline.no_such_function: flows/pipeline.py defines no no_such_function",
        "3: -m flows.no_such_module: no such module",
    ]
    assert broken_pointers('artifacts=["model/config.json"]', code=True) == []


def _code_and_config_files() -> list[Path]:
    return [*(p for folder in CODE_DIRS for p in sorted((REPO / folder).rglob("*.py"))), *CONFIG_FILES]


def test_every_pointer_in_the_code_and_the_configs_resolves():
    broken = [f"{path.relative_to(REPO)}:{problem}" for path in _code_and_config_files()
              for problem in broken_pointers(path.read_text(), code=path.suffix == ".py")]
    assert not broken, "pointers that do not resolve:\n" + "\n".join(broken)


def _help_texts(capsys) -> tuple[str, dict[str, str]]:
    """`gristmill --help` and each subcommand's `--help`, as the user sees them (unwrapped)."""
    from gristmill.flows.cli import _parser

    parser = _parser()
    names = re.search(r"\{([\w,-]+)\}", parser.format_usage()).group(1).split(",")
    helps = {}
    for name in names:
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        helps[name] = capsys.readouterr().out
    return parser.format_help(), helps


def test_every_pointer_in_the_help_resolves_and_the_help_lists_every_command(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a pointer
    top, helps = _help_texts(capsys)
    broken = [f"{name}: {problem}" for name, text in [("gristmill", top), *helps.items()]
              for problem in broken_pointers(text)]
    assert not broken, "pointers in --help that do not resolve:\n" + "\n".join(broken)
    assert "docs/operations.md#servers-gristmill-up" in helps["up"]  # the help was read, not skipped
    unlisted = [name for name in helps if f"gristmill {name}" not in top.split("positional arguments")[0]]
    assert not unlisted, f"`gristmill --help`'s examples (flows/cli.py's docstring) omit {unlisted}"
