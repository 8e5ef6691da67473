"""The layering rules of docs/development.md#layout, enforced on the import graph of our own modules.

Every import counts: at module top, inside functions, and `importlib.import_module("...")` with a
literal name. Layers, top to bottom: flows → infra → tasks → model → core; arrows only point
down, stage packages do not import each other, and there is no cycle anywhere. Inside the collect
stage its folders and modules are layers too (COLLECT_LAYERS). The product imports nothing of
bench/ or tests/, which are not installed; tests import of bench/ only what the two share,
bench/harness/.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("core", "model", "tasks", "infra", "flows")  # installed as gristmill.<folder> (gristmill/)
OURS = (*PRODUCT, "bench", "gristmill")
# What each layer may import of ours (itself included); "gristmill" is the package's own
# __init__ and __main__ (the command line).
ALLOWED = {
    "core": {"core"},
    "model": {"model", "core"},
    "tasks": {"tasks", "model", "core"},
    "infra": {"infra", "tasks", "model", "core"},
    "flows": {"flows", "infra", "tasks", "model", "core"},
    "bench": set(OURS),
    "gristmill": set(PRODUCT),
}


def _sources(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] in PRODUCT:
        parts.insert(0, "gristmill")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path) -> set[str]:
    """Absolute dotted names this file imports, wherever in the file, importlib included."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this file's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import module` imports pkg.module; `from module import name`, module
            names |= {f"{base}.{alias.name}" for alias in node.names}
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def import_graph() -> dict[str, set[str]]:
    """Our module -> our modules it imports (names that are not modules, e.g. `from m import f`,
    resolve to the module m)."""
    modules = {_module_name(p): p for p in _sources(*OURS)}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imported_names(path):
            while imported and imported not in modules:  # a name inside a module: that module
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    for name, targets in _imported_by_registered_name().items():
        if name in graph:
            graph[name] |= targets & set(modules)
    return graph


def _imported_by_registered_name() -> dict[str, set[str]]:
    """Imports whose module name is data, which the parser above cannot see: the align stage
    imports each registered method's module (`METHODS`) when that method runs. (The stage table
    imports each stage's code and publisher inside a loader function: the parser sees those.)"""
    from gristmill.tasks.align.config import METHODS

    return {"gristmill.tasks.align.stage": {m for m in METHODS.values() if isinstance(m, str)}}


def _in_package(module: str) -> list[str]:
    """A module's name below `gristmill.` (gristmill.tasks.sft -> tasks, sft), or as it is."""
    parts = module.split(".")
    return parts[1:] if parts[0] == "gristmill" and len(parts) > 1 and parts[1] in PRODUCT else parts


def _layer(module: str) -> str:
    return _in_package(module)[0]


def _stage(module: str) -> str | None:
    parts = _in_package(module)
    return parts[1] if parts[0] == "tasks" and len(parts) > 1 else None


# The collect stage's layers, bottom to top: reading (the sources, and texts back from files),
# cleaning one document (with its thresholds), what the stage holds and writes (spool, spill,
# funnel, gates, mixing), dedup over what it holds, then the stage's config, what a worker loads
# and where its time goes, its corpus-level steps and `run`.
COLLECT_LAYERS = ("read", "clean", "output", "dedup", "config", "timing", "corpus", "stage")


def _collect_layer(module: str) -> str | None:
    parts = _in_package(module)
    return parts[2] if parts[:2] == ["tasks", "collect"] and len(parts) > 2 else None


def test_every_layer_imports_only_layers_below_it():
    graph = import_graph()
    offenders = {m: sorted(t for t in targets if _layer(t) not in ALLOWED[_layer(m)])
                 for m, targets in graph.items()}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_model_does_not_import_tasks_even_inside_functions():
    graph = import_graph()
    assert graph["gristmill.model.ppo"] and graph["gristmill.model.loop"]  # the graph sees the model package
    assert {m: t for m, t in graph.items() if _layer(m) == "model" and any(_layer(x) == "tasks" for x in t)} == {}


def test_the_graph_sees_modules_imported_by_registered_name():
    graph = import_graph()
    methods = {f"gristmill.tasks.align.{method}" for method in ("dpo", "grpo", "ppo")}
    assert methods <= graph["gristmill.tasks.align.stage"]
    stage_modules = {"gristmill.tasks.collect.stage", "gristmill.tasks.evaluate.stage", "gristmill.flows.reports"}
    assert stage_modules <= graph["gristmill.flows.stages"]


def test_collect_imports_only_its_layers_below():
    graph = import_graph()
    assert "gristmill.tasks.collect.read.readers" in graph["gristmill.tasks.collect.stage"]  # it sees collect
    layers = {layer for m in graph if (layer := _collect_layer(m))}
    assert layers <= set(COLLECT_LAYERS), "give each folder or module of collect its place in COLLECT_LAYERS"
    rank = {layer: i for i, layer in enumerate(COLLECT_LAYERS)} | {None: -1}  # None: not in collect
    upward = {(m, t) for m, targets in graph.items() for t in targets
              if rank[_collect_layer(m)] >= 0 and rank[_collect_layer(t)] > rank[_collect_layer(m)]}
    assert upward == set()


def test_stage_packages_do_not_import_each_other():
    graph = import_graph()
    crossing = {m: sorted(t for t in targets if _stage(t) and _stage(m) and _stage(t) != _stage(m))
                for m, targets in graph.items()}
    assert {m: t for m, t in crossing.items() if t} == {}


def test_there_is_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_checker_sees_cycles_and_importlib(tmp_path, monkeypatch):
    """The rules above can fail: a cycle closed inside a function, through importlib, is found."""
    pkg = tmp_path / "core"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import gristmill.core.b\n")
    (pkg / "b.py").write_text("def f():\n    import importlib\n"
                              "    return importlib.import_module('gristmill.core.a')\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert import_graph()["gristmill.core.b"] == {"gristmill.core.a"}
    with pytest.raises(AssertionError):
        test_there_is_no_import_cycle()


def test_each_stage_package_exposes_the_contract():
    """Each stage of the table is the package `tasks/<stage>`: its entry names config.py's Config,
    VERSION and fingerprint and stage.py's run; the package's `__init__` is only its docstring."""
    import importlib

    from gristmill.flows.stages import STAGES

    assert [p.name for p in sorted((REPO / "tasks").iterdir()) if (p / "__init__.py").is_file()] == sorted(
        spec.name for spec in STAGES)
    for spec in STAGES:
        contract = importlib.import_module(f"gristmill.tasks.{spec.name}.config")
        assert (spec.config, spec.version, spec.fingerprint) == (
            contract.Config, contract.VERSION, contract.fingerprint), spec.name
        stage = importlib.import_module(f"gristmill.tasks.{spec.name}.stage")
        assert spec.run() is stage.run and isinstance(spec.version, int)
        init = ast.parse((REPO / "tasks" / spec.name / "__init__.py").read_text())
        assert len(init.body) == 1 and ast.get_docstring(init), spec.name


def test_the_product_imports_no_benchmark_or_test_code():
    """bench/ and tests/ are not installed: a product module importing them would fail where the
    product is. Tests import their helpers by module name (tests/ is on the path when they run)."""
    not_installed = {"bench", "tests", *(p.stem for p in (REPO / "tests").glob("*.py"))}
    assert {"bench", "conftest", "pipeline_helpers"} <= not_installed
    offenders = {str(p.relative_to(REPO)): sorted(n for n in _imported_names(p) if n.split(".")[0] in not_installed)
                 for p in _sources(*PRODUCT, "gristmill")}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_tests_import_of_bench_only_its_harness():
    """What tests and benchmarks share is bench/harness/, which imports no benchmark: a test runs a
    benchmark only as `python -m bench ...`, never by importing it."""
    def benchmarks(paths: list[Path]) -> dict[str, list[str]]:
        found = {str(p.relative_to(REPO)): sorted(n for n in _imported_names(p) if n.split(".")[0] == "bench"
                                                  and n.split(".")[:2] != ["bench", "harness"])
                 for p in paths}
        return {path: names for path, names in found.items() if names}

    assert benchmarks(_sources("tests")) == {}
    assert benchmarks(_sources("bench/harness")) == {}


def test_mlflow_is_imported_only_by_infra_tracking():
    """The package infra/tracking/ is the only code of ours that imports mlflow."""
    users = {p.relative_to(REPO) for p in _sources("core", "tasks", "model", "infra", "flows", "bench")
             if any(n.split(".")[0] == "mlflow" for n in _imported_names(p))}
    assert {str(p.parent) for p in users} == {"infra/tracking"}


def test_stages_and_models_import_no_orchestration_tracking_or_cluster():
    offenders = {str(p.relative_to(REPO)): {n.split(".")[0] for n in _imported_names(p)} & {"prefect", "mlflow", "ray"}
                 for p in _sources("core", "tasks", "model")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_ray_init_is_called_only_in_infra_ray_engine():
    callers = {str(p.relative_to(REPO)) for p in _sources("core", "tasks", "model", "infra", "flows", "bench")
               if "ray.init(" in p.read_text()}
    assert callers == {"infra/ray_engine.py"}


def test_chat_template_is_defined_once():
    holders = {str(p.relative_to(REPO)) for p in _sources("core", "tasks", "model", "infra", "flows")
               if "<|im_start|>' + message" in p.read_text()}
    assert holders == {"core/chat.py"}


def test_demo_sources_are_parsed_in_one_place():
    parsers = {str(p.relative_to(REPO)) for p in _sources("core", "tasks", "model", "infra", "flows")
               if 'startswith("demo:")' in p.read_text() or "startswith('demo:')" in p.read_text()
               or "startswith(DEMO_PREFIX)" in p.read_text()}
    assert parsers <= {"core/sources.py"}


def test_our_modules_are_imported_only_as_gristmill_modules():
    """The folders are installed as `gristmill.<folder>` (gristmill/): an import of `core.x` or
    `tasks.y` would find a user's own `core` or `tasks` package first, or none."""
    bare = {str(p.relative_to(REPO)): sorted(n for n in _imported_names(p) if n.split(".")[0] in PRODUCT)
            for p in [*_sources(*OURS), *_sources("tests")]}
    assert {path: names for path, names in bare.items() if names} == {}
