"""The stage table (flows/stages.py) is the one place a stage is declared: the pipeline config, the
plan and the call of a stage's code all come from it, and a stage receives its upstream manifests as
keyword arguments named after those stages, checked before it runs."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
from pathlib import Path

import pytest

from gristmill.core.stage import Manifest, SerialEngine
from gristmill.flows.config import PipelineConfig, build_config_class, load_config
from gristmill.flows.dag import PlannedStage, plan, run_planned, stage_device
from gristmill.flows.stages import COLLECT, PRETRAIN, STAGE_NAMES, STAGES, StageSpec, checked, upstream_parameters
from gristmill.infra.artifacts import ArtifactStore

CONFIG = '''"""The shout stage's contract."""
from pydantic import Field

from gristmill.core.stage import StageConfig

VERSION = 1


class Config(StageConfig):
    times: int = Field(1, ge=1, description="How many times the text is repeated.")
'''

STAGE = '''"""The shout stage: the tokenize stage's words, upper-cased."""
from pathlib import Path

from gristmill.core.stage import StageResult


def run(config, out_dir, *, engine, tokenize):
    text = (Path(tokenize.path) / "words.txt").read_text().upper() * config.times
    (Path(out_dir) / "shout.txt").write_text(text)
    return StageResult(stats={"chars": len(text)})
'''


@pytest.fixture
def shout(tmp_path, monkeypatch):
    """A throwaway stage: a package on sys.path (config.py, stage.py) and its one table entry."""
    package = tmp_path / "packages" / "shout_stage"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""Stage shout."""\n')
    (package / "config.py").write_text(CONFIG)
    (package / "stage.py").write_text(STAGE)
    monkeypatch.syspath_prepend(str(package.parent))
    contract = importlib.import_module("shout_stage.config")
    yield StageSpec(name="shout", run=lambda: importlib.import_module("shout_stage.stage").run, config=contract.Config,
                    description="The tokenize stage's words, upper-cased.", version=contract.VERSION,
                    upstream=("tokenize",))
    for name in [n for n in sys.modules if n.split(".")[0] == "shout_stage"]:
        del sys.modules[name]


def _commit_fake_tokenize(store: ArtifactStore, stage: PlannedStage) -> Manifest:
    def compute(partial: Path) -> dict:
        (partial / "words.txt").write_text("grist for the mill ")
        return {"config": {}, "upstream": {}, "stats": {}, "meta": {}}

    return store.materialize("tokenize", stage.key, compute)[0]


def test_a_stage_added_in_one_entry_is_configured_planned_and_run(shout, tmp_path):
    table = (*STAGES, shout)
    config_class = build_config_class(table)
    assert config_class.model_fields["shout"].description == shout.description
    config = load_config(None, ["shout.times=3"], config_class)
    assert config.shout.times == 3 and config.pretrain == PipelineConfig().pretrain

    store = ArtifactStore(tmp_path / "store")
    planned = {p.spec.name: p for p in plan(config, store)}
    assert list(planned) == [*STAGE_NAMES, "shout"] and not planned["shout"].complete
    # its key follows its own config and its upstream's
    assert plan(load_config(None, [], config_class), store)[-1].key != planned["shout"].key
    moved = plan(load_config(None, ["shout.times=3", "tokenize.vocab_size=600"], config_class), store)
    assert moved[-1].key != planned["shout"].key

    tokenize = _commit_fake_tokenize(store, planned["tokenize"])
    stage = planned["shout"]
    manifest, reused = store.materialize("shout", stage.key, lambda partial: {
        "config": {}, "upstream": {"tokenize": tokenize.key}, "meta": {},
        "stats": run_planned(stage, {"tokenize": tokenize}, partial, engine=SerialEngine(), store_mapping=None).stats})
    assert not reused and manifest.stats == {"chars": 3 * len("grist for the mill ")}
    assert (manifest.path / "shout.txt").read_text() == "GRIST FOR THE MILL " * 3
    assert plan(config, store)[-1].complete


def test_a_stage_gets_exactly_its_upstream_each_of_its_own_stage(shout, tmp_path):
    stage = PlannedStage(spec=shout, config=shout.config(), key="k", complete=False)
    words = tmp_path / "words"
    words.mkdir()
    (words / "words.txt").write_text("a")
    with pytest.raises(ValueError, match=r"takes upstream \['tokenize'\], given \[\]"):
        run_planned(stage, {}, tmp_path, engine=SerialEngine(), store_mapping=None)
    with pytest.raises(ValueError, match="another stage"):
        run_planned(stage, {"tokenize": Manifest.of_directory("collect", words)}, tmp_path,
                    engine=SerialEngine(), store_mapping=None)
    run_planned(stage, {"tokenize": Manifest.of_directory("tokenize", words)}, tmp_path,
                engine=SerialEngine(), store_mapping=None)
    assert (tmp_path / "shout.txt").read_text() == "A"
    with pytest.raises(TypeError, match=r"takes upstream \['tokenize'\], the stage table gives it \['sft'\]"):
        dataclasses.replace(shout, upstream=("sft",)).load_run()


def test_every_stage_run_takes_the_upstream_its_entry_names():
    for spec in STAGES:
        assert upstream_parameters(spec.load_run()) == set(spec.upstream), spec.name
        # a training stage (one with a launch section) is told where its checkpoints live; no other is
        takes_mapping = "store_mapping" in inspect.signature(spec.load_run()).parameters
        assert takes_mapping == (spec.launch is not None), spec.name
        assert spec.publisher is None or callable(spec.load_publisher()), spec.name


def test_the_pipeline_config_has_one_section_per_stage_of_the_table():
    assert PipelineConfig.stages == STAGES
    sections = {name: field for name, field in PipelineConfig.model_fields.items() if name in STAGE_NAMES}
    assert list(sections) == list(STAGE_NAMES)
    assert all(sections[s.name].annotation is s.config and sections[s.name].description == s.description
               for s in STAGES)


def test_a_table_lists_each_stage_after_its_upstream_and_once():
    assert checked(STAGES) == STAGES
    with pytest.raises(ValueError, match=r"'tokenize': upstream \['collect'\] must come before it"):
        checked([STAGES[1], STAGES[0]])
    with pytest.raises(ValueError, match="'collect' is in the table twice"):
        build_config_class([STAGES[0], STAGES[0]])


# Modules outside the stage packages that still spell stage names, and why.
SPELLS_STAGE_NAMES = {
    "infra/store_records.py": "the corpus-version chain (collect_dir) sits below the table's layer",
    "flows/reports.py": "the table's publishers: importing the table back would close an import cycle",
    "flows/cli.py": "the `gristmill evaluate` command's name: a command of its own, not the stage",
}


def _spelled_stage_names(path: Path) -> list[str]:
    """String constants of `path` (docstrings aside) that are a stage name, or a key built on one
    (`collect.sources`, `evaluate-<key>`, `sft/...`)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [f"{path.name}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and any(node.value == name or node.value.startswith((f"{name}.", f"{name}-", f"{name}/"))
                    for name in STAGE_NAMES)]


def test_stages_are_named_only_through_the_table_outside_their_packages():
    repo = Path(__file__).resolve().parents[2]
    spelled = {str(path.relative_to(repo)): found for folder in ("core", "model", "infra", "flows")
               for path in sorted((repo / folder).rglob("*.py"))
               if path.name != "stages.py" and (found := _spelled_stage_names(path))}
    assert {name: found for name, found in spelled.items() if name not in SPELLS_STAGE_NAMES} == {}


def test_the_stage_name_check_finds_a_spelled_name(tmp_path):
    (tmp_path / "m.py").write_text('"""evaluate"""\nKEY = "evaluate"\nPATH = "collect.sources"\nOK = "collected"\n')
    assert _spelled_stage_names(tmp_path / "m.py") == ["m.py:2 'evaluate'", "m.py:3 'collect.sources'"]


def test_an_entry_reads_its_stages_launch_and_device(tmp_path):
    config = load_config(None, ["align.method=ppo", "align.ppo.policy.device=cpu", "sft.device=cuda",
                                "pretrain.launch.processes=2"])
    planned = {p.spec.name: p for p in plan(config, ArtifactStore(tmp_path))}
    assert [stage_device(planned[name]) for name in ("pretrain", "sft", "align")] == ["auto", "cuda", "cpu"]
    assert planned["pretrain"].launch == config.section(PRETRAIN).launch and planned["pretrain"].launch.processes == 2
    assert planned["collect"].launch is None and planned["evaluate"].launch is None
    assert planned["collect"].ray_workers == config.section(COLLECT).num_workers
    assert planned["pretrain"].ray_workers == 1
    assert [spec.name for spec in STAGES if spec.uses_ray] == ["collect", "tokenize"]
