"""What installing gristmill promises (pyproject.toml, uv.lock, docs/development.md#dependencies-and-the-lock):

- uv.lock is current against pyproject.toml;
- every lower bound is true: gristmill resolves with the GPU image's versions, with every direct
  dependency at its lower bound at once, and with the pins an environment reported to us. Resolved
  only: `uv pip compile` reads wheels' metadata, so torch and the rest are never downloaded;
- installed into an environment that already holds torch and older numpy and requests, the wheel
  leaves torch's files as they were and puts nothing outside its declared range;
- the wheel holds the one package `gristmill` (its modules, the data files they read at run time)
  and the `gristmill` command, and no bench/ or tests/.

A run from a folder holding its own `model.py` and `tasks/` imports neither (tests/infra/test_launch.py).
Needs uv (installed beside torch by the README's command) and PyPI."""
from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path
from typing import NamedTuple, NoReturn

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# gristmill's own requirements (not its extras') that apply here
DIRECT = [req for req in map(Requirement, PROJECT["dependencies"]) if req.marker is None or req.marker.evaluate()]
# The GPU image's versions, on its Python 3.12 (docs/development.md#the-gpu-check).
GPU_IMAGE = {"torch": "2.11.0", "accelerate": "1.15.0", "transformers": "5.17.0"}
# Pins of an environment gristmill is to install into (the issue that brought the ranges): the
# lock's exact versions must not be required.
REPORTED = {"torch": "2.11.0", "transformers": "5.17.0", "numpy": "2.3.5", "requests": "2.32.5",
            "cryptography": "46.0.3"}
# In range but not the newest: an environment's own versions that installing gristmill must not move out of range.
BESIDE = {"numpy": "2.3.5", "requests": "2.32.5"}
# Under the package's folders and not installed: the image's build file, used from a checkout.
NOT_SHIPPED = {"gristmill/infra/docker/Dockerfile"}
# Local state a checkout may hold, left out of the copy the wheel is built from.
NOT_COPIED = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".gristmill", ".hypothesis", ".whl", "site",
              "mlruns", "mlflow.db", "bench/results", "tests/artifacts"}
RESOLVE_TIMEOUT_S = 300


def _unavailable(why: str) -> NoReturn:
    """What this machine lacks: a failure in CI, else a skip."""
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def _uv() -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    return uv or _unavailable("uv not found: `pip install uv` beside torch (README)")


def _run(*args: str | Path, cwd: Path, timeout: int = RESOLVE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`args`, which must succeed (its stderr is the failure's message)."""
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def _lower(req: Requirement) -> Version | None:
    return next((Version(s.version) for s in req.specifier if s.operator == ">="), None)


def _pins(compiled: str) -> dict[str, str]:
    """canonical name -> version of each `name==version` line of `uv pip compile --no-annotate`."""
    lines = (line.strip().partition("==") for line in compiled.splitlines() if not line.lstrip().startswith("#"))
    return {canonicalize_name(name): version for name, _, version in lines if version}


def test_the_lock_is_current():
    done = subprocess.run([_uv(), "lock", "--check"], cwd=REPO, capture_output=True, text=True,
                          timeout=RESOLVE_TIMEOUT_S)
    says = [line for line in done.stderr.splitlines() if "`uv lock`" in line]  # "hint: ... run `uv lock`."
    assert done.returncode == 0, says[0] if says else done.stderr


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """gristmill resolved (`uv pip compile` of pyproject.toml, the pins as constraints) with the GPU
    image's versions on its Python, with every lower bound at once, and with the reported pins; the
    three at once, as each mostly waits on PyPI. --no-build: metadata from wheels only, nothing
    built. Lowest: uv's --resolution lowest-direct alone is a heuristic (it took packaging 26.4,
    which a newer virtualenv asks for, where 24.2 resolves beside an older one), so the bounds
    are asked for as constraints too."""
    folder = tmp_path_factory.mktemp("resolve")
    lowest = {req.name: str(bound) for req in DIRECT if (bound := _lower(req)) is not None}
    asks = {"gpu_image": (GPU_IMAGE, ["--python-version", "3.12"]),
            "lowest": (lowest, ["--python-version", "3.11", "--resolution", "lowest-direct"]),
            "reported": (REPORTED, ["--python-version", "3.11"])}
    uv = _uv()

    def compile_with(name: str) -> subprocess.CompletedProcess:
        pins, flags = asks[name]
        constraints = folder / f"{name}.txt"
        constraints.write_text("".join(f"{package}=={version}\n" for package, version in pins.items()))
        # from the folder: no [tool.uv] of the checkout's applies (the lock's torch exclusion)
        return subprocess.run([uv, "pip", "compile", "--no-header", "--no-annotate", "--no-build", *flags,
                               str(REPO / "pyproject.toml"), "-c", str(constraints)],
                              cwd=folder, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S)

    with ThreadPoolExecutor(len(asks)) as pool:
        return dict(zip(asks, pool.map(compile_with, asks)))


@pytest.mark.parametrize("ask, versions", [("gpu_image", GPU_IMAGE), ("reported", REPORTED)])
def test_gristmill_resolves_with_an_environments_versions(resolved, ask, versions):
    """With the GPU image's versions (on its Python 3.12), and with the pins an environment reported."""
    done = resolved[ask]
    assert done.returncode == 0, done.stderr
    pins = _pins(done.stdout)
    assert {name: pins.get(name) for name in versions} == versions


def test_every_lower_bound_resolves_at_once(resolved):
    """Each bound names a release (not a yanked one) that resolves with all the others at theirs."""
    done = resolved["lowest"]
    assert done.returncode == 0, done.stderr
    assert "is yanked" not in done.stderr, done.stderr
    pins = _pins(done.stdout)
    bounded = [req for req in DIRECT if _lower(req) is not None]
    got = {req.name: pins.get(canonicalize_name(req.name)) for req in bounded}
    assert {name: version and Version(version) for name, version in got.items()} == \
        {req.name: _lower(req) for req in bounded}


class Built(NamedTuple):
    wheel: Path
    source: Path  # the copy of the checkout it was built from


def _not_copied(folder: str, names: list[str]) -> set[str]:
    here = Path(folder).relative_to(REPO)
    return {name for name in names if name in NOT_COPIED or (here / name).as_posix() in NOT_COPIED
            or fnmatch(name, "*.egg-info") or fnmatch(name, ".*_cache")}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """The wheel `uv build` makes of a copy of the checkout (built in the checkout itself, setuptools
    would leave build/ there, whose stale files a later wheel could take in)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "gristmill"
    shutil.copytree(REPO, source, symlinks=True, ignore=_not_copied)
    _run(_uv(), "build", "--wheel", "-q", "-o", root / "dist", source, cwd=root)
    (wheel,) = (root / "dist").glob("gristmill-*.whl")
    return Built(wheel, source)


def _package_files(package: Path) -> set[str]:
    """Every file under `package` (its links to the top-level folders followed), as the wheel names it."""
    return {(Path(folder) / name).relative_to(package.parent).as_posix()
            for folder, dirs, names in os.walk(package, followlinks=True)
            for name in names if "__pycache__" not in Path(folder).parts and not name.endswith(".pyc")}


def test_the_wheel_holds_gristmill_its_data_and_the_command(built):
    with zipfile.ZipFile(built.wheel) as wheel:
        names = wheel.namelist()
        info = next(name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info"))
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
        declared = [line.split(":", 1)[1].strip() for line in wheel.read(f"{info}/METADATA").decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    shipped = {name for name in names if not name.startswith(f"{info}/")}
    assert {name.split("/")[0] for name in shipped} == {"gristmill"}
    assert [name for name in names if name.startswith(("bench/", "tests/", "gristmill/bench/", "gristmill/tests/"))] \
        == []
    # every module and data file of the package's folders, and nothing else (no stale build output)
    expected = _package_files(built.source / "gristmill") - NOT_SHIPPED
    assert sorted(expected - shipped) == [], "missing from the wheel"
    assert sorted(shipped - expected) == [], "in the wheel, not in the checkout"
    read_at_run_time = ["gristmill/core/stage.py", "gristmill/flows/cli.py", "gristmill/infra/accelerate/ddp_cpu.yaml",
                        "gristmill/infra/accelerate/fsdp_gpu.yaml",
                        "gristmill/tasks/evaluate/lm_eval_tasks/gristmill_gsm8k.yaml",
                        "gristmill/tasks/collect/read/demo_reference.json"]
    assert [name for name in read_at_run_time if name not in shipped] == []
    scripts = configparser.ConfigParser()
    scripts.read_string(entry_points)
    assert {section: dict(scripts[section]) for section in scripts.sections()} == \
        {"console_scripts": {"gristmill": "gristmill.flows.cli:console"}}

    def key(req: Requirement) -> tuple:
        return canonicalize_name(req.name), tuple(sorted(req.extras)), str(req.specifier)

    in_wheel = {key(req) for req in map(Requirement, declared) if req.marker is None}  # extras' have markers
    assert in_wheel == {key(req) for req in map(Requirement, PROJECT["dependencies"])}


def _installed(site: Path) -> dict[str, metadata.Distribution]:
    return {canonicalize_name(dist.metadata["Name"]): dist for dist in metadata.distributions(path=[str(site)])}


def _files(dist: metadata.Distribution) -> dict[str, tuple[int, int, int] | None]:
    """Each file `dist` installed (its RECORD) -> (inode, mtime, size); None where it is gone."""
    def stat(path: Path) -> tuple[int, int, int] | None:
        try:
            found = path.stat()
        except FileNotFoundError:
            return None
        return found.st_ino, found.st_mtime_ns, found.st_size

    return {str(file): stat(Path(str(file.locate()))) for file in dist.files or []}


# Run by the venv's Python from elsewhere: where gristmill is imported from, and the files the code
# reads at run time that are not there.
PROBE = """import json, gristmill
from gristmill.core.launch import ACCELERATE_CONFIGS
from gristmill.tasks.collect.read.demo_crawl import REFERENCE_FILE
from gristmill.tasks.evaluate.generation import YAML_PATH
print(json.dumps({"package": gristmill.__file__,
                  "absent": [str(p) for p in (ACCELERATE_CONFIGS / "ddp_cpu.yaml", REFERENCE_FILE, YAML_PATH)
                             if not p.is_file()]}))"""


def test_installing_the_wheel_keeps_torch_and_moves_nothing_out_of_range(built, tmp_path):
    """A venv holding pip's torch (this one's version, from pip's find-links: an index's torch
    may be a multi-GB CUDA build, so none is asked for) and older numpy and requests: `uv pip
    install` of the wheel leaves every file of torch as it was, installs every requirement in its
    range, and the command and its data files work from the venv."""
    uv = _uv()
    torch = metadata.version("torch")
    torch_needs = [str(req) for req in map(Requirement, metadata.requires("torch") or [])
                   if req.marker is None or req.marker.evaluate({"extra": ""})]
    if any(canonicalize_name(Requirement(req).name).startswith(("nvidia-", "triton")) for req in torch_needs):
        _unavailable(f"torch {torch} is a CUDA build: its libraries would be downloaded")
    venv = tmp_path / "venv"
    _run(uv, "venv", "-q", "--seed", "--python", sys.executable, venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          f"torch=={torch}"], capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        _unavailable(f"no torch {torch} wheel on pip's find-links: {pip.stderr.strip()[-500:]}")
    _run(uv, "pip", "install", "-q", "--python", python, *torch_needs,
         *(f"{name}=={version}" for name, version in BESIDE.items()), cwd=tmp_path)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
                .stdout.strip())
    before = {name: dist.version for name, dist in _installed(site).items()}
    torch_files = _files(_installed(site)["torch"])
    assert before["torch"] == torch and len(torch_files) > 1000

    # The constraint only guards: a resolution that wanted another torch fails here, not downloads one.
    (tmp_path / "torch.txt").write_text(f"torch=={torch}\n")
    _run(uv, "pip", "install", "-q", "--python", python, "-c", tmp_path / "torch.txt", built.wheel, cwd=tmp_path)

    installed = _installed(site)
    after = {name: dist.version for name, dist in installed.items()}
    assert after["gristmill"] == PROJECT["version"] and after["torch"] == torch
    now = _files(installed["torch"])
    assert sorted(f for f in torch_files.keys() | now.keys() if torch_files.get(f) != now.get(f))[:5] == []
    out_of_range = [f"{req} (installed: {after.get(canonicalize_name(req.name))})" for req in DIRECT
                    if not req.specifier.contains(after.get(canonicalize_name(req.name), "0"), prereleases=True)]
    assert out_of_range == []
    moved = {name: f"{before[name]} -> {after.get(name)}" for name in before if after.get(name) != before[name]}
    print(f"installed beside: {BESIDE}; moved by the install: {moved or 'nothing'}")  # numpy, requests: in range above
    _run(uv, "pip", "check", "--python", python, cwd=tmp_path)  # every installed package's requirements met
    probe = json.loads(_run(python, "-c", PROBE, cwd=tmp_path).stdout)
    assert probe == {"package": str(site / "gristmill" / "__init__.py"), "absent": []}
    command = _run(venv / "bin" / "gristmill", "--help", cwd=tmp_path)
    assert command.stdout.startswith("usage: gristmill")
