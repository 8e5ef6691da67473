"""`python -m bench gpu` runs on a bare GPU image: here on the CPU, in a fresh venv holding only what
such an image has, each at the lowest version pyproject.toml allows (CPU torch 2.13, the oldest this
machine installs without a CUDA download, standing in for its torch 2.11), plus the wheels the
check carries. An import of Prefect, Ray, MLflow or anything else off that list from the training
path fails this test."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from gristmill.core.gpu_image import CARRIED

REPO = Path(__file__).resolve().parents[2]
# The GPU image's packages (docs/development.md#the-gpu-check) but torch.
IMAGE = ("transformers", "accelerate", "tokenizers", "numpy", "safetensors", "pyyaml", "psutil")


def _lowest(names: tuple[str, ...]) -> list[str]:
    """`name==<lower bound>` of each of `names`, as pyproject.toml declares them."""
    declared = map(Requirement, tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    bounds = {r.name.lower(): s.version for r in declared for s in r.specifier if s.operator == ">="}
    return [f"{name}=={bounds[name]}" for name in names]


def _bare_venv(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    python = root / "bin" / "python"
    # --no-compile: pip byte-compiles all of torch's thousands of modules as it installs them, most of
    # the install's time; the check imports a fraction of them, compiled as they are first imported
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", "torch==2.13.0"], check=True)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    installer = ([uv, "pip", "install", "-q", "--python", str(python)] if uv
                 else [python, "-m", "pip", "install", "-q"])
    subprocess.run([*installer, *_lowest(IMAGE), *CARRIED], check=True)
    return python


def test_the_gpu_check_runs_with_only_the_gpu_images_packages(tmp_path):
    python = _bare_venv(tmp_path / "venv")
    env = {"PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path),
           "PYTHONPATH": str(REPO), "PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    for service in ("prefect", "ray", "mlflow"):  # the venv really lacks the pipeline's services
        assert subprocess.run([python, "-c", f"import {service}"], env=env, capture_output=True).returncode != 0
    done = subprocess.run([python, "-m", "bench", "gpu", "--steps", "6", "--work", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.stdout.strip(), done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["parts"] == dict.fromkeys(["data", "pretrain_adamw", "pretrain_muon", "sft", "evaluate"],
                                            "pass"), done.stderr[-4000:]
    assert done.returncode == 0
    assert report["world_size"] == 2 and report["tokens_per_s_per_gpu"] > 0 and report["mfu"] is None  # a CPU
    pretrained = json.loads((tmp_path / "work" / "pretrain-adamw" / "summary.json").read_text())
    assert pretrained["world_size"] == 2 and (tmp_path / "work" / "sft" / "model" / "model.safetensors").is_file()
