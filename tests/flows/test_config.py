"""Pipeline config: YAML presets, dotted overrides, strict keys, errors that name the field,
and which fields reach the artifact hash."""
from __future__ import annotations

from pathlib import Path

import pytest

from gristmill.flows.config import ConfigError, PipelineConfig, load_config
from gristmill.flows.dag import plan
from gristmill.flows.stages import STAGE_NAMES, stages_until
from gristmill.infra.artifacts import ArtifactStore

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_tiny_preset_loads_and_matches_its_yaml():
    config = load_config(TINY)
    assert config.name == "tiny"
    assert config.pretrain.max_steps == 300 and config.pretrain.model.hidden_size == 128
    assert config.collect.sources == ["demo:python-docs"]


def test_overrides_are_parsed_as_yaml_values():
    config = load_config(TINY, ["pretrain.max_steps=7", "sft.lr=5e-4", "collect.sources=[a.jsonl, b.warc.gz]",
                                "pretrain.model.num_layers=3"])
    assert config.pretrain.max_steps == 7 and isinstance(config.pretrain.max_steps, int)
    assert config.sft.lr == 5e-4
    assert config.collect.sources == ["a.jsonl", "b.warc.gz"]
    assert config.pretrain.model.num_layers == 3


@pytest.mark.parametrize("override, named", [
    ("sft.lrr=1", "unknown config key 'sft.lrr'"),
    ("nosuchstage.x=1", "unknown config key 'nosuchstage'"),
    ("pretrain.model.hidden=3", "unknown config key 'pretrain.model.hidden'"),
])
def test_unknown_keys_are_errors_that_name_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(TINY, [override])


def test_invalid_values_name_the_field():
    with pytest.raises(ConfigError, match=r"pretrain\.max_steps"):
        load_config(TINY, ["pretrain.max_steps=-1"])
    with pytest.raises(ConfigError, match=r"pretrain"):
        load_config(TINY, ["pretrain.seq_len=4096"])  # longer than model.max_seq_len


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(TINY, ["pretrain.max_steps"])


def test_until_names_a_stage():
    assert [s.name for s in stages_until("pretrain")] == ["collect", "tokenize", "pretrain"]
    assert [s.name for s in stages_until(None)] == list(STAGE_NAMES)
    with pytest.raises(ValueError, match="pretrian"):
        stages_until("pretrian")


def _keys(config: PipelineConfig, tmp_path: Path) -> dict[str, str]:
    return {p.spec.name: p.key for p in plan(config, ArtifactStore(tmp_path))}


def test_a_change_moves_the_key_of_its_stage_and_everything_downstream(tmp_path):
    base = _keys(load_config(TINY), tmp_path)
    changed = _keys(load_config(TINY, ["sft.lr=5e-4"]), tmp_path)
    assert [s for s in STAGE_NAMES if base[s] != changed[s]] == ["sft", "align", "evaluate"]


def test_operational_knobs_do_not_change_keys(tmp_path):
    base = _keys(load_config(TINY), tmp_path)
    assert _keys(load_config(TINY, ["collect.num_workers=1", "tokenize.num_workers=3", "pretrain.checkpoint_every=7",
                                    "pretrain.log_every=3"]), tmp_path) == base
    assert _keys(load_config(TINY, ["pretrain.seed=1"]), tmp_path)["pretrain"] != base["pretrain"]


def test_cli_dry_run_takes_overrides_before_or_after_options(tmp_path, monkeypatch, capsys):
    from gristmill.flows.cli import main

    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path))
    assert main(["run", str(TINY), "--until", "pretrain", "pretrain.max_steps=7", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 7" in out
    plan_rows = [line.split() for line in out.split("# plan", 1)[1].splitlines()[1:] if line.strip()]
    assert [(row[0], row[2]) for row in plan_rows] == [("collect", "run"), ("tokenize", "run"), ("pretrain", "run")]
    assert main(["run", str(TINY), "sft.lrr=1", "--dry-run"]) == 2
    assert "unknown config key 'sft.lrr'" in capsys.readouterr().err


def test_missing_or_empty_sources_are_found_when_the_run_is_planned(tmp_path, monkeypatch, capfd):
    """Before any service starts, for a run and a dry run alike: one line naming the source, exit 2
    (a run plans in its supervised child, whose stderr this captures)."""
    from gristmill.flows.cli import main

    monkeypatch.setenv("GRISTMILL_HOME", str(tmp_path / "home"))
    (tmp_path / "empty").mkdir()
    for override in (f"collect.sources=[{tmp_path / 'missing.jsonl'}]", f"sft.data=[{tmp_path / 'empty'}]",
                     f"align.grpo.prompts=[{tmp_path / 'missing.jsonl'}]"):
        for dry in ([], ["--dry-run"]):
            assert main(["run", str(TINY), override, *dry]) == 2
            err = capfd.readouterr().err
            assert err.startswith("gristmill: source ") and str(tmp_path) in err and err.count("\n") == 1


def test_moved_align_keys_say_where_they_went():
    with pytest.raises(ConfigError, match=r"'align\.lr' \(it moved: use 'align\.<method>\.lr'\)"):
        load_config(TINY, ["align.lr=1e-4"])
    with pytest.raises(ConfigError, match=r"rollout_batch_size.*align\.ppo\.policy\.batch_size"):
        load_config(TINY, ["align.ppo.policy.rollout_batch_size=8"])


def test_yaml_mistakes_name_the_file_or_override_with_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsft:\n  lr: [1, 2\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml, line \d+, column \d+: invalid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"override 'collect\.sources=\[a,', line 1, column \d+: invalid YAML"):
        load_config(TINY, ["collect.sources=[a,"])
    with pytest.raises(ConfigError, match=r"missing\.yaml: no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad.write_text("name: x\nsft:\n  lr: 0.1\npretrain:\n  max_steps: 3\nsft:\n  max_steps: 2\n")  # PyYAML: last wins
    with pytest.raises(ConfigError, match=r"bad\.yaml, line 6, column 1: .*'sft' given twice \(first on line 2\)"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"override 'sft=\{lr: 1, lr: 2\}'.*'lr' given twice"):
        load_config(TINY, ["sft={lr: 1, lr: 2}"])
    assert load_config(TINY, ["sft={lr: 1, max_steps: 2}"]).sft.max_steps == 2  # distinct keys pass


def test_an_empty_config_file_is_an_error_not_the_tiny_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    for text in ("", "# only a comment\n", "\n\n"):
        empty.write_text(text)
        with pytest.raises(ConfigError, match=r"empty\.yaml: the config file is empty.*configs/tiny\.yaml"):
            load_config(empty)


@pytest.mark.parametrize("override, key", [
    ("pretrain.max_steps=true", "pretrain.max_steps"), ("sft.lr=false", "sft.lr"),
    ("pretrain.model.hidden_size=true", "pretrain.model.hidden_size"),
    ("align={grpo: {max_prompts: true}}", "align.grpo.max_prompts")])  # an `int | None` in a section
def test_a_boolean_for_a_number_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}: the boolean (true|false) given to a "
                                          "field that takes none"):
        load_config(TINY, [override])


def test_booleans_still_set_boolean_fields():
    assert load_config(TINY, ["registry.enabled=false"]).registry.enabled is False


@pytest.mark.parametrize("override, stage, known", [
    ("collect.sources=[demo:nope]", "collect", "demo:python-docs"),
    ("sft.data=[demo:python-docs]", "sft", "demo:arithmetic"),
    ("align.grpo.prompts=[demo:nope]", "align", "demo:arithmetic")])
def test_an_unknown_demo_source_is_found_when_the_run_is_planned(tmp_path, override, stage, known):
    with pytest.raises(ValueError, match=rf"{stage} source '[^']+': unknown demo source \(known: {known}\)"):
        plan(load_config(TINY, ["align.method=grpo", override]), ArtifactStore(tmp_path))
