"""The process is configured once, before Prefect, MLflow, Ray or Hugging Face is imported
(flows/entry.py): importing the deployment entrypoint in a fresh interpreter with a hostile
environment (no gristmill variables, another working directory holding a `prefect.toml` that says
otherwise, no Prefect profile) still gives every tool gristmill's settings, as each tool reads them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

READ_SETTINGS = """
import json, os
{first}
from prefect.settings import get_current_settings
from mlflow.environment_variables import MLFLOW_DISABLE_TELEMETRY
from huggingface_hub import constants as hf
from ray._private import ray_constants

settings = get_current_settings()
print(json.dumps({{
    "gristmill_home": os.environ.get("GRISTMILL_HOME"),
    "prefect_home": str(settings.home),
    "prefect_analytics": settings.server.analytics_enabled,
    "prefect_startup_timeout_s": settings.server.ephemeral.startup_timeout_seconds,
    "prefect_extra_loggers": settings.logging.extra_loggers,
    "mlflow_telemetry_off": MLFLOW_DISABLE_TELEMETRY.get(),
    "hf_offline": hf.HF_HUB_OFFLINE,
    "ray_binds_network": ray_constants.ENABLE_RAY_CLUSTER,
}}))
"""
# The deployment entrypoint of prefect.yaml: configures, then imports the flow module, whose
# first import is Prefect.
ENTRYPOINT = "import gristmill.flows.deployment"


def _settings(tmp_path: Path, first: str) -> dict:
    """What the tools read in a fresh interpreter that runs `first`, then imports them."""
    cwd, user_home = tmp_path / "elsewhere", tmp_path / "user"
    cwd.mkdir()
    user_home.mkdir()
    (cwd / "prefect.toml").write_text(f'home = "{tmp_path / "toml-home"}"\n\n'
                                      "[server]\nanalytics_enabled = true\n")
    hostile = {k: v for k, v in os.environ.items()
               if not k.startswith(("GRISTMILL_", "PREFECT_", "MLFLOW_", "RAY_", "HF_", "DO_NOT_TRACK",
                                    "TOKENIZERS_"))}
    result = subprocess.run([sys.executable, "-c", READ_SETTINGS.format(first=first)], cwd=cwd,
                            env={**hostile, "HOME": str(user_home)}, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_deployment_entrypoint_configures_the_process_before_the_flow_imports_prefect(tmp_path):
    seen = _settings(tmp_path, ENTRYPOINT)
    home = tmp_path / "elsewhere" / ".gristmill"
    assert seen == {
        "gristmill_home": str(home), "prefect_home": str(home / "prefect"), "prefect_analytics": False,
        "prefect_startup_timeout_s": 180, "prefect_extra_loggers": ["gristmill"],
        "mlflow_telemetry_off": True, "hf_offline": True, "ray_binds_network": False}


def test_the_check_sees_prefect_imported_before_the_entrypoint(tmp_path):
    """The check above can fail: a process that imports Prefect first keeps Prefect's own
    settings (the working directory's prefect.toml here), whatever is configured after."""
    seen = _settings(tmp_path, f"import prefect\n{ENTRYPOINT}")
    assert seen["gristmill_home"] == str(tmp_path / "elsewhere" / ".gristmill")
    assert seen["prefect_home"] == str(tmp_path / "toml-home") and seen["prefect_analytics"] is True
