"""The pipeline config: one typed section per stage, loaded from a YAML preset plus dotted overrides.

    gristmill run configs/tiny.yaml pretrain.max_steps=50 sft.lr=3e-4

The stage sections come from the stage table (flows/stages.py): a stage added there has its section
here. Unknown keys are errors that name the key; each stage later receives only its own section.
"""
from __future__ import annotations

import inspect
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from gristmill.core.stage import StageConfig
from gristmill.flows.notify import NotifyConfig
from gristmill.flows.stages import ALIGN, STAGES, StageSpec, checked

C = TypeVar("C", bound=StageConfig)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the offending key."""


class RegistryConfig(BaseModel):
    """Where the aligned model of each run goes in MLflow's model registry, and when it becomes the
    champion (flows/registry.py). Not part of any artifact key: it changes no stage output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Register the aligned model of every run that reaches evaluate "
                                                    "(alias 'candidate'); false: leave the registry alone.")
    model_name: str | None = Field(default=None, description="Registered model name; None: 'gristmill-<name>', one "
                                                             "model per pipeline configuration.")
    promote_on: list[str] = Field(
        default=["aligned.arith_acc"], min_length=1,
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

    cron: str = Field(default="0 3 * * 1", description="When the served `data-refresh` deployment runs (cron, UTC; "
                                                        "default Mondays 03:00). `gristmill serve --refresh-cron` "
                                                        "overrides it.")
    min_new_tokens: int = Field(
        default=1_000_000, ge=0,
        description="Start the `pipeline` deployment on the corpus when a refresh added at least this many "
                    "clean tokens, estimated as the new version's clean UTF-8 bytes / bytes_per_token "
                    "(no tokenizer exists before the pipeline trains one).")
    bytes_per_token: float = Field(default=4.0, gt=0, description="Clean text bytes per token for the estimate "
                                                                  "(about 4 for English with a BPE vocabulary).")
    trigger_pipeline: bool = Field(default=True, description="Start the `pipeline` deployment when the threshold "
                                                             "is met; false: only publish the corpus version.")
    deployment: str = Field(default="pipeline/pipeline", description="The deployment started ('flow/deployment').")


class StoreConfig(BaseModel):
    """How the artifact store checks a committed output before reusing it (infra/artifacts.py).
    Not part of any artifact key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verify_on_reuse: Literal["size", "sha256"] = Field(
        default="size", description="size: every file's size, and the sha256 of files up to 1 MiB (configs, "
                                    "tokenizers, model configs); sha256: every file's bytes, at the cost of reading "
                                    "them all (`gristmill verify` checks a whole store on demand).")


class PipelineConfigBase(BaseModel):
    """Every stage's config. Field defaults are the `tiny` preset (2 CPU cores, minutes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: ClassVar[tuple[StageSpec[Any], ...]] = ()  # the table the sections were made from, in DAG order

    if TYPE_CHECKING:
        # The fields `build_config_class` adds after the stage sections (NAME_FIELD, OTHER_SECTIONS),
        # as the type checker sees them; a stage's section is `section(spec)`.
        name: str
        registry: RegistryConfig
        notify: NotifyConfig
        refresh: RefreshConfig
        store: StoreConfig

        def __init__(self, **data: Any) -> None:
            """Every section has a default; the class `build_config_class` makes validates them."""

    @property
    def registered_model_name(self) -> str:
        return self.registry.model_name or f"gristmill-{self.name}"

    def section(self, spec: StageSpec[C]) -> C:
        """The config section of stage `spec` (a table entry of this config's class), of its type."""
        section = getattr(self, spec.name)  # the field named after the stage: made from the table
        if not isinstance(section, spec.config):
            raise TypeError(f"section {spec.name!r} is a {type(section).__name__}, not {spec.config.__name__}")
        return section


NAME_FIELD = Field(default="tiny", description="Name of this pipeline configuration, shown in Prefect and MLflow.")
# The sections that are not stages (none changes a stage output); they follow the stages' sections
# in the Prefect form and a dry run.
OTHER_SECTIONS: dict[str, Any] = {
    "registry": (RegistryConfig, Field(default_factory=RegistryConfig,
                                       description="Model registry: candidate and champion aliases.")),
    "notify": (NotifyConfig, Field(default_factory=NotifyConfig, description="Failure and rollback "
                                   "notifications (webhook, Prefect events).")),
    "refresh": (RefreshConfig, Field(default_factory=RefreshConfig,
                                     description="Scheduled data refresh: new inputs into corpus versions.")),
    "store": (StoreConfig, Field(default_factory=StoreConfig, description="How committed artifacts are "
                                 "checked before reuse.")),
}


def build_config_class(stages: Sequence[StageSpec[Any]]) -> type[PipelineConfigBase]:
    """The pipeline config of a stage table: `name`, one section per stage (its config type, with
    its defaults and the table's description), then the other sections."""
    stages = checked(stages)
    sections = {spec.name: (spec.config, Field(default_factory=spec.config, description=spec.description))
                for spec in stages}
    model = create_model("PipelineConfig", __base__=PipelineConfigBase, __module__=__name__,
                         __doc__=PipelineConfigBase.__doc__, name=(str, NAME_FIELD), **sections,
                         **OTHER_SECTIONS)
    model.stages = stages
    return model


if TYPE_CHECKING:
    # The checker sees the class the table makes as its base: the stage sections are reached
    # through `section(spec)`, typed by the table's entries.
    PipelineConfig = PipelineConfigBase
else:
    PipelineConfig = build_config_class(STAGES)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


# Keys renamed when every trainer started sharing core.train_config.TrainConfig: where they went.
MOVED_KEYS = {
    **{f"{ALIGN.name}.{knob}": f"{ALIGN.name}.<method>.{knob}" for knob in
       ("lr", "max_steps", "batch_size", "warmup_frac", "seed", "device", "checkpoint_every", "max_seq_len")},
    f"{ALIGN.name}.log_every_steps": f"{ALIGN.name}.<method>.log_every",
    f"{ALIGN.name}.ppo.reward_model.log_every_steps": f"{ALIGN.name}.ppo.reward_model.log_every",
    f"{ALIGN.name}.ppo.policy.rollout_batch_size": f"{ALIGN.name}.ppo.policy.batch_size",
    f"{ALIGN.name}.ppo.policy.max_grad_norm": f"{ALIGN.name}.ppo.policy.grad_clip",
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one
    silently, so an edited preset that repeats a section would lose the first one's settings."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first on line {first_line[key]})", key_node.start_mark)
            first_line.setdefault(key, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, where: str) -> Any:
    """YAML text; a syntax error or a repeated key is a ConfigError naming `where` with line and column."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader that refuses repeated keys
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{where}{at}: invalid YAML: {problem}") from None


def load_config(path: Path | str | None = None, overrides: Sequence[str] = (),
                config_class: type[PipelineConfigBase] = PipelineConfig) -> PipelineConfigBase:
    """Read a YAML preset (or only defaults when `path` is None) and apply `key=value` overrides;
    values are parsed as YAML, so `pretrain.max_steps=50` is an int and `collect.sources=[a,b]` a list.
    `config_class` is another stage table's (`build_config_class`)."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"{path}: no such config file")
        loaded = _parse_yaml(Path(path).read_text(), str(path))
        if loaded is None:  # run as `tiny`, every default, it would look like the tiny preset
            raise ConfigError(f"{path}: the config file is empty (or only comments): name a preset such as "
                              "configs/tiny.yaml, or give at least `name:`")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of stage sections at the top level")
        data = loaded
    return _validated(config_class, data, overrides, str(path or "config"))


def with_overrides(config: PipelineConfigBase, overrides: Sequence[str]) -> PipelineConfigBase:
    """`config` with `key=value` overrides applied (the Prefect form's free-form overrides)."""
    if not overrides:
        return config
    return _validated(type(config), config.model_dump(mode="json"), overrides, "config")


def _validated(config_class: type[PipelineConfigBase], data: dict[str, Any], overrides: Sequence[str],
               where: str) -> PipelineConfigBase:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(data, key.strip(), _parse_yaml(raw, f"override {item!r}"))
    _refuse_booleans(config_class, data, f"{where}: ")
    try:
        return config_class.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"{where}: {_describe(error)}") from None


def _takes_boolean(annotation: Any) -> bool:
    """Whether a field of this type means something by `true`/`false` (bool, Any, a union or
    Literal with a boolean in it)."""
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(value, bool) for value in get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_takes_boolean(member) for member in get_args(annotation))
    return False


def _section(annotation: Any) -> type[BaseModel] | None:
    """The config section type of a field (`X` or `X | None`), None for a plain value."""
    for candidate in (annotation, *get_args(annotation)):
        if inspect.isclass(candidate) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _refuse_booleans(model: type[BaseModel], data: Any, prefix: str) -> None:
    """ConfigError naming the key where a YAML boolean is given to a field that takes none: pydantic
    would read `pretrain.max_steps=true` as 1 (and `sft.lr=true` as 1.0)."""
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            continue  # an unknown key: validation names it
        key = f"{prefix}{name}"
        if isinstance(value, bool) and not _takes_boolean(field.annotation):
            raise ConfigError(f"{key}: the boolean {str(value).lower()} given to a field that takes none "
                              f"({getattr(field.annotation, '__name__', field.annotation)})")
        if (section := _section(field.annotation)) is not None:
            _refuse_booleans(section, value, f"{key}.")
