"""The default run's text (`demo:python-docs`, tasks/collect/read/demo_crawl.py) is named by its digest:
installed from the lock it is the reference corpus, installing or removing any other package
leaves every artifact key as it was, and an environment whose corpus distributions differ runs
with one line at plan time saying so, and plans keys of its own.

Other environments are real venvs made in a second (`python -m venv --without-pip`) whose
site-packages links to this one's entries, less some, plus a package of our own."""
from __future__ import annotations

import json
import re
import site
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

from pipeline_helpers import REPO, cli_env

from gristmill.tasks.collect.config import Config, fingerprint
from gristmill.tasks.collect.read import demo_crawl

# Installed for the tests or the docs only, none of them in the corpus: what a base install lacks.
NOT_CORPUS = ("pytest", "mkdocs", "ruff", "pyright", "lm-eval", "moto", "playwright", "hypothesis")
PROBE_README = ("probe-pkg is a small package that a user installs beside gristmill. Its description is long "
                "enough to pass every cleaning rule of the tiny preset, and it ships a README as well.\n") * 20


def _locked_versions() -> dict[str, str]:
    """normalized name -> version of each distribution in uv.lock."""
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    return {demo_crawl.normalize_name(package["name"]): package["version"] for package in lock["package"]}


def _dist_info(site_packages: Path, name: str) -> Path | None:
    return next((p for p in site_packages.glob("*.dist-info")
                 if demo_crawl.normalize_name(p.name.split("-")[0]) == name), None)


def _entries(dist_info: Path) -> set[str]:
    """What a distribution put into site-packages: its RECORD's top-level names."""
    rows = (dist_info / "RECORD").read_text().splitlines()
    return {row.split(",")[0].split("/")[0] for row in rows if row and not row.startswith("..")} | {dist_info.name}


def _write_probe(site_packages: Path) -> None:
    """A pure-Python distribution as an installer leaves it: a package, its dist-info, a shipped README."""
    (site_packages / "probe_pkg").mkdir()
    (site_packages / "probe_pkg" / "__init__.py").write_text("")
    (site_packages / "probe_pkg" / "README.md").write_text(PROBE_README)
    info = site_packages / "probe_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: probe-pkg\nVersion: 1.0\n\n{PROBE_README}")
    (info / "RECORD").write_text("probe_pkg/__init__.py,,\nprobe_pkg/README.md,,\nprobe_pkg-1.0.dist-info/METADATA,,\n"
                                 "probe_pkg-1.0.dist-info/RECORD,,\n")


def _venv(root: Path, hide: set[str] = frozenset(), changed: dict[str, str] | None = None,
          probe: bool = False) -> Path:
    """A venv holding this one's packages but the distributions `hide`, with the versions in `changed`
    (name -> version, in its metadata) and with probe-pkg when `probe`; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    ours = Path(site.getsitepackages()[0])
    theirs = Path(next(root.glob("lib/python*/site-packages")))
    hidden = set().union(*(_entries(info) for name in hide if (info := _dist_info(ours, name))))
    relabelled = {info.name: (info, version) for name, version in (changed or {}).items()
                  if (info := _dist_info(ours, name))}
    for entry in ours.iterdir():
        if entry.name in hidden:
            continue
        if entry.name not in relabelled:
            (theirs / entry.name).symlink_to(entry)
            continue
        info, version = relabelled[entry.name]  # the same files, its metadata at another version
        copy = theirs / f"{info.name.split('-')[0]}-{version}.dist-info"
        copy.mkdir()
        for file in info.iterdir():
            if file.is_file():
                (copy / file.name).symlink_to(file)
        metadata = (info / "METADATA").read_text()
        (copy / "METADATA").unlink()
        (copy / "METADATA").write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", metadata, count=1))
    if probe:
        _write_probe(theirs)
    return root / "bin" / "python"


def _gristmill(python: Path | str, home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "gristmill", *args], cwd=REPO, env=cli_env(home),
                          capture_output=True, text=True, timeout=300)


def _installed(python: Path, names: tuple[str, ...]) -> dict[str, str | None]:
    probe = ("import importlib.metadata as m, json\n"
             "def version(name):\n"
             "    try: return m.version(name)\n"
             "    except m.PackageNotFoundError: return None\n"
             f"print(json.dumps({{name: version(name) for name in {names!r}}}))")
    return json.loads(subprocess.run([str(python), "-c", probe], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout)


def test_the_lock_installs_the_reference_corpus():
    """The reference's versions are the lock's, and this environment (installed from the lock, as
    the README's commands and CI install) reads the reference's bytes."""
    known, locked = demo_crawl.reference(), _locked_versions()
    assert sorted(known.versions) == sorted(demo_crawl.CORPUS)
    assert "torch" not in demo_crawl.CORPUS  # its build, and so its version string, differs per machine
    assert known.versions == {name: locked.get(name) for name in demo_crawl.CORPUS}
    packages = demo_crawl.list_packages()
    assert {demo_crawl.normalize_name(name): version for name, version in packages} == known.versions
    digest = demo_crawl.corpus_digest(packages)
    assert digest.sha256 == known.sha256 and digest.packages == len(demo_crawl.CORPUS)
    assert demo_crawl.reference_difference(packages, digest) is None


def test_other_packages_installed_or_removed_leave_every_key(tmp_path):
    """A base install lacks the test tools; a user adds packages of their own. Neither changes the
    demo's digest or any stage's key, as `--dry-run` prints them: two environments with the lock's
    corpus plan equal keys."""
    ours = Path(site.getsitepackages()[0])
    removed = {name for name in NOT_CORPUS if _dist_info(ours, name)}
    assert removed, "none of the test-only distributions is installed here"
    python = _venv(tmp_path / "venv", hide=removed, probe=True)
    seen = _installed(python, (*sorted(removed), "probe-pkg"))
    assert seen == {**dict.fromkeys(removed), "probe-pkg": "1.0"}  # the environments do differ
    here = _gristmill(sys.executable, tmp_path / "home", "run", "configs/tiny.yaml", "--dry-run")
    there = _gristmill(python, tmp_path / "home", "run", "configs/tiny.yaml", "--dry-run")
    assert here.returncode == there.returncode == 0, there.stderr
    assert f"# {demo_crawl.DEMO_SOURCE} (collect): {demo_crawl.corpus_digest()}\n" in here.stdout
    assert there.stdout == here.stdout  # the config, the demo's digest, every stage's key


def _keys(stdout: str) -> dict[str, str]:
    """stage -> artifact key, from a `--dry-run`'s plan rows."""
    plan = stdout[stdout.index("\n# plan"):].splitlines()[1:]
    return {row.split()[0]: row.split()[1] for row in plan if len(row.split()) == 3}


def test_another_corpus_runs_with_one_line_and_keys_of_its_own(tmp_path):
    """A corpus distribution at another version and one missing: the plan says so in one line and
    goes on, with another collect key (and so every key downstream)."""
    python = _venv(tmp_path / "venv", hide={"wtforms"}, changed={"jmespath": "0.0.1"})
    here = _gristmill(sys.executable, tmp_path / "home", "run", "configs/tiny.yaml", "--dry-run")
    there = _gristmill(python, tmp_path / "home", "run", "configs/tiny.yaml", "--dry-run")
    assert here.returncode == there.returncode == 0, there.stderr
    assert here.stderr == ""
    known = demo_crawl.reference().sha256[:16]
    line = re.fullmatch(r"gristmill: demo corpus ([0-9a-f]{16}) differs from the reference ([0-9a-f]{16}): "
                        r"1 distributions at other versions, 1 missing; artifact keys and figures will differ\n",
                        there.stderr)
    assert line and line[2] == known and line[1] != known, there.stderr
    ours, theirs = _keys(here.stdout), _keys(there.stdout)
    assert list(ours) == list(theirs) and all(ours[stage] != theirs[stage] for stage in ours)


def test_a_run_says_its_corpus_differs_at_plan_time_and_goes_on(tmp_path, monkeypatch, capsys):
    """`gristmill run`'s supervised child, with a reference this environment does not match: the
    line on stderr, then the pipeline starts (its services and flow stand-ins here)."""
    from gristmill.flows import supervised

    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(demo_crawl, "reference", lambda: demo_crawl.Reference("0" * 64, {}))
    started = []
    monkeypatch.setattr(supervised, "EmbeddedServices", lambda home: SimpleNamespace(launch=lambda: None))
    monkeypatch.setattr(supervised, "_run", lambda config, services, until, approve: started.append(until) or 0)
    assert supervised.run(str(REPO / "configs" / "tiny.yaml"), [], until="collect") == 0
    digest = demo_crawl.corpus_digest().sha256[:16]
    assert capsys.readouterr().err == (f"gristmill: demo corpus {digest} differs from the reference 0000000000000000: "
                                       "0 distributions at other versions, 0 missing; artifact keys and figures will "
                                       "differ\n")
    assert started == ["collect"]


def test_a_requirement_the_environment_does_not_meet_stops_the_plan_in_one_line(tmp_path):
    """A torch older than the lowest one tested, or the S3 backend removed after the install: one
    line naming the requirement, before anything runs."""
    older_torch = _venv(tmp_path / "older-torch", changed={"torch": "2.10.0"})
    for args in (["--dry-run"], ["--until", "collect"]):
        proc = _gristmill(older_torch, tmp_path / "home", "run", "configs/tiny.yaml", *args)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr == "gristmill: gristmill needs torch>=2.11 (installed: 2.10.0)\n"
    no_s3 = _venv(tmp_path / "no-s3", hide={"s3fs"})
    proc = _gristmill(no_s3, tmp_path / "home", "run", "configs/tiny.yaml", "--dry-run")
    assert (proc.returncode, proc.stderr) == (2, "gristmill: gristmill needs s3fs>=2026.9 (not installed)\n")
    assert not (tmp_path / "home" / "artifacts").exists()  # stopped before anything ran


def test_the_digest_follows_a_pinned_distributions_text(tmp_path, monkeypatch):
    """A corpus distribution installed from a source tree changes its text without a new
    version: the digest is of the bytes read, so the collect key follows."""
    name, version = next((n, v) for n, v in demo_crawl.list_packages() if demo_crawl.normalize_name(n) == "flask")
    info = tmp_path / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n")
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n"
    (info / "METADATA").write_text(metadata + "A web framework, described one way.\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # first on the path: what the crawl reads
    before = demo_crawl.corpus_digest(), fingerprint(Config())
    (info / "METADATA").write_text(metadata + "A web framework, described another way.\n")
    after = demo_crawl.corpus_digest(), fingerprint(Config())
    assert after[0].packages == before[0].packages and after[0].sha256 != before[0].sha256
    assert after[1] != before[1]


def test_the_demo_reads_the_environment_wherever_a_run_starts(tmp_path):
    """`python -m` in a source checkout puts the working directory on sys.path, where a checkout's
    `*.egg-info` would shadow the installed metadata: the demo's text (and so the collect key)
    would depend on where a run was started (a console script and the Ray workers start elsewhere)."""
    name, version = demo_crawl.list_packages()[0]
    checkout = tmp_path / "checkout"
    info = checkout / f"{name}.egg-info"
    info.mkdir(parents=True)
    (info / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nA checkout.\n")
    probe = "from gristmill.tasks.collect.read.demo_crawl import corpus_digest; print(corpus_digest())"
    seen = [subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True,
                           check=True).stdout for cwd in (checkout, tmp_path)]
    assert seen[0] == seen[1] == f"{demo_crawl.corpus_digest()}\n"

