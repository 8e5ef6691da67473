"""The pipeline config: one typed section per stage, loaded from a YAML preset plus dotted overrides.

    gristmill run configs/tiny.yaml pretrain.max_steps=50 sft.lr=3e-4

Unknown keys are errors that name the key; each stage later receives only its own section.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from flows.notify import NotifyConfig
from tasks.align import Config as AlignConfig
from tasks.collect import Config as CollectConfig
from tasks.evaluate import Config as EvaluateConfig
from tasks.pretrain import Config as PretrainConfig
from tasks.sft import Config as SFTConfig
from tasks.tokenize import Config as TokenizeConfig


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the offending key."""


class RegistryConfig(BaseModel):
    """Where the aligned model of each run goes in MLflow's model registry, and when it becomes the
    champion (flows/registry.py). Not part of any artifact key: it changes no stage output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Register the aligned model of every run that reaches evaluate "
                                            "(alias 'candidate'); false: leave the registry alone.")
    model_name: str | None = Field(None, description="Registered model name; None: 'gristmill-<name>', one "
                                                     "model per pipeline configuration.")
    promote_on: list[str] = Field(
        ["aligned.arith_acc"], min_length=1,
        description="Metrics '<model>.<metric>' of the evaluate stage's results.json (models: base, sft, "
                    "aligned) on which a candidate must beat the champion to take the alias 'champion': no "
                    "worse on every one and better on at least one. Lower is better for names containing "
                    "'loss', 'ppl' or 'bpb', higher for the rest.")

    @field_validator("promote_on")
    @classmethod
    def _dotted(cls, value: list[str]) -> list[str]:
        for name in value:
            if len(name.split(".")) != 2 or not all(name.split(".")):
                raise ValueError(f"{name!r} is not '<model>.<metric>', e.g. 'aligned.arith_acc'")
        return value


class RefreshConfig(BaseModel):
    """The `data-refresh` deployment (flows/refresh.py): when it runs, and when a new corpus
    version is worth a pipeline run. Not part of any artifact key: it changes no stage output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cron: str = Field("0 3 * * 1", description="When the served `data-refresh` deployment runs (cron, UTC; "
                                                "default Mondays 03:00). `gristmill serve --refresh-cron` "
                                                "overrides it.")
    min_new_tokens: int = Field(
        1_000_000, ge=0,
        description="Start the `pipeline` deployment on the corpus when a refresh added at least this many "
                    "clean tokens, estimated as the new version's clean UTF-8 bytes / bytes_per_token "
                    "(no tokenizer exists before the pipeline trains one).")
    bytes_per_token: float = Field(4.0, gt=0, description="Clean text bytes per token for the estimate "
                                                          "(about 4 for English with a BPE vocabulary).")
    trigger_pipeline: bool = Field(True, description="Start the `pipeline` deployment when the threshold "
                                                     "is met; false: only publish the corpus version.")
    deployment: str = Field("pipeline/pipeline", description="The deployment started ('flow/deployment').")


class PipelineConfig(BaseModel):
    """Every stage's config. Field defaults are the `tiny` preset (2 CPU cores, minutes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("tiny", description="Name of this pipeline configuration, shown in Prefect and MLflow.")
    collect: CollectConfig = Field(default_factory=CollectConfig, description="Collect and clean raw documents.")
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig, description="Train the tokenizer, write token shards.")
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig, description="Next-token pretraining.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised fine-tuning on conversations.")
    align: AlignConfig = Field(default_factory=AlignConfig, description="Preference alignment.")
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, description="Evaluation and report.")
    registry: RegistryConfig = Field(default_factory=RegistryConfig,
                                     description="Model registry: candidate and champion aliases.")
    notify: NotifyConfig = Field(default_factory=NotifyConfig,
                                 description="Failure and rollback notifications (webhook, Prefect events).")
    refresh: RefreshConfig = Field(default_factory=RefreshConfig,
                                   description="Scheduled data refresh: new inputs into corpus versions.")

    @property
    def registered_model_name(self) -> str:
        return self.registry.model_name or f"gristmill-{self.name}"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


# Keys renamed when every trainer started sharing core.settings.TrainSettings: where they went.
MOVED_KEYS = {
    **{f"align.{knob}": f"align.<method>.{knob}" for knob in
       ("lr", "max_steps", "batch_size", "warmup_frac", "seed", "device", "checkpoint_every", "max_seq_len")},
    "align.log_every_steps": "align.<method>.log_every",
    "align.ppo.reward_model.log_every_steps": "align.ppo.reward_model.log_every",
    "align.ppo.policy.rollout_batch_size": "align.ppo.policy.batch_size",
    "align.ppo.policy.max_grad_norm": "align.ppo.policy.grad_clip",
}


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden" and key in MOVED_KEYS:
            lines.append(f"unknown config key {key!r} (it moved: use {MOVED_KEYS[key]!r})")
        elif item["type"] == "extra_forbidden":
            lines.append(f"unknown config key {key!r}")
        else:
            lines.append(f"{key}: {item['msg']}")
    return "; ".join(lines)


def _parse_yaml(text: str, where: str) -> Any:
    """YAML text; a syntax error is a ConfigError naming `where` with line and column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{where}{at}: invalid YAML: {problem}") from None


def load_config(path: Path | str | None = None, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Read a YAML preset (or only defaults when `path` is None) and apply `key=value` overrides;
    values are parsed as YAML, so `pretrain.max_steps=50` is an int and `collect.sources=[a,b]` a list."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"{path}: no such config file")
        loaded = _parse_yaml(Path(path).read_text(), str(path))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of stage sections at the top level")
        data = loaded or {}
    return _validated(data, overrides, str(path or "config"))


def with_overrides(config: PipelineConfig, overrides: Sequence[str]) -> PipelineConfig:
    """`config` with `key=value` overrides applied (the Prefect form's free-form overrides)."""
    return _validated(config.model_dump(mode="json"), overrides, "config") if overrides else config


def _validated(data: dict[str, Any], overrides: Sequence[str], where: str) -> PipelineConfig:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(data, key.strip(), _parse_yaml(raw, f"override {item!r}"))
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"{where}: {_describe(error)}") from None
