"""Process environment for gristmill: one root for all state, offline, no telemetry.

`configure` sets it, once per process and before Prefect, MLflow or Ray is imported, because
they read these variables at import: flows/entry.py calls it, and every process entry point
imports that module first. Variables the user has set are respected (`setdefault`), so
`PREFECT_API_URL`, `MLFLOW_TRACKING_URI`, `RAY_ADDRESS` or `PREFECT_HOME` point the run at real
services.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

DEFAULT_HOME = ".gristmill"

OFFLINE_AND_QUIET = {
    "HF_HUB_OFFLINE": "1",  # nothing is downloaded from a hub at run time
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",  # tokenizers' own threads fight forked workers
    # gristmill records to MLflow itself (infra/tracking/); without this, TRL imports MLflow in every
    # alignment rank for a Trainer callback it never uses (docs/benchmarks.md, start-up).
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    # Ray >= 2.5x turns token auth on by default; a local single-user cluster does not need it.
    "RAY_AUTH_MODE": "disabled",
    # The embedded Prefect API starts a server subprocess; on a busy 2-core machine it can need
    # more than the default 20 s to come up.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    # `gristmill serve` picks up a run started from the UI within 2 s, not Prefect's default 10 s
    # (one query of the Prefect server each time).
    "PREFECT_RUNNER_POLL_FREQUENCY": "2",
    # Route the stages' `gristmill.*` loggers into Prefect's run logs (and so into the UI).
    "PREFECT_LOGGING_EXTRA_LOGGERS": "gristmill",
}


# Ray rewrites a loopback address (RAY_ADDRESS=127.0.0.1:6379, `--node-ip-address 127.0.0.1`) into
# this machine's network IP, so a head bound to 127.0.0.1 only would be unreachable. With its
# single-machine switch off ("0"), 127.0.0.1 stays 127.0.0.1 on both sides.
RAY_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def keep_ray_on_loopback(environ: MutableMapping[str, str] = os.environ) -> None:
    """A Ray this machine starts (no RAY_ADDRESS) or a `gristmill up` head (a loopback
    RAY_ADDRESS) stays on 127.0.0.1: without the switch (see above) a local Ray's GCS, raylet and
    agents listen on every interface. Ray reads it when imported, so call this before."""
    address = environ.get("RAY_ADDRESS", "")
    if not address or is_loopback(address.rpartition(":")[0]):
        environ.setdefault(RAY_SINGLE_MACHINE, "0")


def home_path() -> Path:
    """$GRISTMILL_HOME (default ./.gristmill), resolved; not created (commands that only read a
    home, `verify` and `run --dry-run`, must not leave one behind)."""
    return Path(os.environ.get("GRISTMILL_HOME", DEFAULT_HOME)).resolve()


class HomeError(ValueError):
    """GRISTMILL_HOME or the artifact store is not a folder this process can write in."""


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be (or be created as) a folder to write in: its nearest existing part is
    not a folder, or a file cannot be made there (a read-only mount, no permission: tried, since
    root passes a permission check on a read-only mount's mode bits); None when it can."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        handle, probe = tempfile.mkstemp(prefix=".gristmill-write-check-", dir=existing)
    except OSError as error:
        return f"{existing} cannot be written ({error.strerror or error})"
    os.close(handle)
    os.unlink(probe)
    return None


def checked_home(home: Path) -> Path:
    """`home`, once a run's state can be written there; HomeError naming it otherwise (one line,
    before anything fails on it with a traceback)."""
    if problem := unwritable(home):
        raise HomeError(f"GRISTMILL_HOME={home}: {problem}")
    return home


def gristmill_home() -> Path:
    """$GRISTMILL_HOME (default ./.gristmill), created if missing."""
    home = home_path()
    home.mkdir(parents=True, exist_ok=True)
    return home


def prefect_home(home: Path) -> Path:
    """Prefect's state under GRISTMILL_HOME (its database is prefect.db there): a run's default
    PREFECT_HOME and the home of the server `gristmill up` starts, so both are one history."""
    return Path(home).resolve() / "prefect"


def configure(home: Path | None = None) -> Path:
    """Point every component's state at `home` (default $GRISTMILL_HOME or ./.gristmill, created
    if missing), keep the process offline, without telemetry and with a local Ray on loopback;
    returns the home (HomeError when it cannot be written)."""
    home = checked_home(Path(home or os.environ.get("GRISTMILL_HOME", DEFAULT_HOME)).resolve())
    home.mkdir(parents=True, exist_ok=True)  # Prefect makes its home inside at import
    os.environ["GRISTMILL_HOME"] = str(home)
    for name, value in OFFLINE_AND_QUIET.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("PREFECT_HOME", str(prefect_home(home)))
    keep_ray_on_loopback()
    # Prefect attaches its handlers to the extra loggers but leaves their level at WARNING.
    logging.getLogger("gristmill").setLevel(logging.INFO)
    return home


def short_path(path: Path, max_chars: int) -> Path:
    """`path`, or when it is longer than `max_chars` (a Unix socket's limit is 107 bytes) a short
    one in /tmp named by a hash of it: one long path, always the same short one."""
    if len(str(path)) <= max_chars:
        return path
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    return Path("/tmp") / f"gristmill-{path.stem}-{digest}{path.suffix}"


def artifacts_root(home: Path) -> Path:
    return Path(home) / "artifacts"


def mlflow_store_uri(home: Path) -> str:
    """MLflow's SQLite store under GRISTMILL_HOME: the embedded default and the backend of the
    MLflow server `gristmill up` starts, so runs logged either way are one history."""
    return f"sqlite:///{Path(home).resolve()}/mlflow.db"


def mlflow_artifacts_root(home: Path) -> Path:
    """Where MLflow artifacts live under GRISTMILL_HOME (never ./mlruns of the cwd)."""
    return Path(home).resolve() / "mlruns"


def reports_root(home: Path) -> Path:
    """Report cards, one folder per pipeline run (MLflow run id): rendered, never artifacts."""
    return Path(home) / "reports"


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The package version plus the git commit of the checkout, when there is one."""
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    try:
        base = version("gristmill")
    except PackageNotFoundError:
        base = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{base}+{commit}" if commit else base


def requirement_problems(distribution: str = "gristmill") -> list[str]:
    """Each of `distribution`'s installed requirements (not its extras') that this environment
    does not meet, one line each naming the requirement: a torch older than the lowest tested, a
    dependency removed after the install. Empty when `distribution` is not installed (the lean
    GPU check runs the training path from a checkout) or everything is met."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    problems = []
    for requirement in map(Requirement, requires):
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{distribution} needs {requirement.name}{requirement.specifier} (not installed)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{distribution} needs {requirement.name}{requirement.specifier} (installed: {version})")
    return problems
