"""Basic auth for `gristmill up`'s servers (infra/stack.py): on when these variables are set in `up`'s
environment, and required to expose a server to the network (`check_exposure`). Prefect checks
every API call against "user:password" (clients send PREFECT_API_AUTH_STRING); MLflow runs its
basic-auth app, whose admin is created on first start with this password (clients send
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD). Health URLs stay open.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from gristmill.infra import env

PREFECT_AUTH = "PREFECT_SERVER_API_AUTH_STRING"
MLFLOW_AUTH = "MLFLOW_AUTH_ADMIN_PASSWORD"
MLFLOW_SECRET = "MLFLOW_FLASK_SERVER_SECRET_KEY"  # signs the auth app's CSRF tokens


def check_exposure(host: str) -> None:
    """A server reachable from the network must ask for credentials: refuse before anything starts."""
    if env.is_loopback(host):
        return
    missing = [name for name in (PREFECT_AUTH, MLFLOW_AUTH) if not os.environ.get(name)]
    if missing:
        raise ValueError(f"--host {host} exposes Prefect and MLflow to the network: set "
                         f"{' and '.join(missing)} first (basic auth; see docs/operations.md#exposing-the-servers)")


def mlflow_auth(home: Path, folder: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    """MLflow's basic-auth app, when its admin password is set: its users in a SQLite file under
    the home, its settings file and CSRF key (made once, kept private) in `folder`, beside the service
    records."""
    if not os.environ.get(MLFLOW_AUTH):
        return (), {}
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "mlflow-auth.ini"
    config.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{home / 'mlflow-auth.db'}\n"
        f"admin_username = {os.environ.get('MLFLOW_TRACKING_USERNAME', 'admin')}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    secret = os.environ.get(MLFLOW_SECRET)
    if not secret:
        key_file = folder / "mlflow-secret-key"
        if not key_file.exists():
            key_file.touch(mode=0o600)
            key_file.write_text(secrets.token_hex(32))
        secret = key_file.read_text()
    return ("--app-name", "basic-auth"), {"MLFLOW_AUTH_CONFIG_PATH": str(config), MLFLOW_SECRET: secret}

