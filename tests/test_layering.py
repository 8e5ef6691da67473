"""The layering rules of DESIGN.md, enforced: stages and models import no frameworks of the edges,
and each edge framework has exactly one owner module."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _sources(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))]


def test_stages_and_models_import_no_orchestration_tracking_or_cluster():
    offenders = {str(p.relative_to(REPO)): _imports(p) & {"prefect", "mlflow", "ray", "flows", "infra"}
                 for p in _sources("tasks", "model")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_mlflow_is_imported_only_by_infra_tracking():
    users = {str(p.relative_to(REPO)) for p in _sources("tasks", "model", "infra", "flows", "bench")
             if "mlflow" in _imports(p)}
    assert users == {"infra/tracking.py"}


def test_ray_init_is_called_only_in_infra_ray_engine():
    callers = {str(p.relative_to(REPO)) for p in _sources("tasks", "model", "infra", "flows", "bench")
               if "ray.init(" in p.read_text()}
    assert callers == {"infra/ray_engine.py"}


def test_chat_template_is_defined_once():
    holders = {str(p.relative_to(REPO)) for p in _sources("tasks", "model", "infra", "flows")
               if "<|im_start|>' + message" in p.read_text()}
    assert holders == {"tasks/chat.py"}
