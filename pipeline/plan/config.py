"""Release configs (``configs/*.yaml``): parsed once into frozen, typed models.

Relative paths inside a config (checkpoint, grid file, local store) are relative to the
config file's own directory, so a config means the same thing from any working directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline._yaml import Located, load_yaml
from pipeline.contracts import backend_table
from pipeline.contracts.bucket import Bucket
from pipeline.contracts.store_layout import DEFAULT_STORE, NAME_PATTERN
from pipeline.errors import ConfigError
from pipeline.plan.buckets import BucketGrid, PositiveInt
from pipeline.plan.instances import INSTANCES

GqaStrategy = Literal["auto", "replicate_to_tp_degree", "convert_to_mha"]
Dtype = Literal["float32", "bfloat16", "float16"]
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class _Section(BaseModel):
    # Unknown keys are errors: a typo must never be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    name: Name
    checkpoint: Path
    dtype: Dtype = "bfloat16"

    @field_validator("dtype", mode="before")
    @classmethod
    def _alias(cls, v: Any) -> Any:
        return DTYPE_ALIASES.get(v, v)


class TargetSection(_Section):
    backend: str = "auto"
    instance_type: str = "inf2.xlarge"
    tp_degree: PositiveInt = 1
    gqa_strategy: GqaStrategy = "auto"

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v != "auto" and v not in backend_table.BACKENDS:
            raise ValueError(
                f"unknown backend '{v}'; allowed: auto, {', '.join(backend_table.names())}"
            )
        return v

    @field_validator("instance_type")
    @classmethod
    def _known_instance(cls, v: str) -> str:
        if v not in INSTANCES:
            raise ValueError(f"unknown instance type '{v}'; allowed: {', '.join(INSTANCES)}")
        return v


class BucketsSection(_Section):
    grid: Path | None = None
    batch_sizes: list[PositiveInt] | None = None
    sequence_lengths: list[PositiveInt] | None = None
    prefill_lengths: list[PositiveInt] | None = None  # overrides the grid file's
    mixed_lengths: list[PositiveInt] | None = None  # overrides the grid file's

    @model_validator(mode="after")
    def _one_source(self) -> BucketsSection:
        inline = self.batch_sizes is not None or self.sequence_lengths is not None
        if self.grid is not None and inline:
            raise ValueError(
                "give either 'grid' or inline 'batch_sizes'/'sequence_lengths', not both"
            )
        if self.grid is None and (self.batch_sizes is None or self.sequence_lengths is None):
            raise ValueError("give a 'grid' file or both 'batch_sizes' and 'sequence_lengths'")
        return self


class CompilerSection(_Section):
    flags: list[str] = Field(default_factory=list)
    auto_cast_type: Literal["bf16", "fp16", "tf32", "fp32"] = "bf16"
    timeout_s: PositiveInt = 7200

    @field_validator("flags", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return v.split() if isinstance(v, str) else v


class ReleaseConfig(_Section):
    model: ModelSection
    target: TargetSection = Field(default_factory=TargetSection)
    buckets: BucketsSection
    compiler: CompilerSection = Field(default_factory=CompilerSection)
    store: str = DEFAULT_STORE


@dataclass(frozen=True)
class Release:
    """A loaded config: the typed model with paths resolved, the bucket grid, and the source."""

    path: Path
    config: ReleaseConfig
    grid: BucketGrid
    source: dict[str, Any]

    @property
    def name(self) -> str:
        return self.config.model.name

    @property
    def checkpoint(self) -> Path:
        return self.config.model.checkpoint

    @property
    def buckets(self) -> list[Bucket]:
        return self.grid.buckets()

    @property
    def store_url(self) -> str:
        return self.config.store


def load_config(path: Path | str) -> Release:
    """Load and validate a release config and its grid; errors name file:line and field."""
    path = Path(path)
    located = load_yaml(path)
    config = validate_located(located, ReleaseConfig)
    base = path.parent
    model = config.model.model_copy(update={"checkpoint": _resolve(base, config.model.checkpoint)})
    update: dict[str, Any] = {"model": model, "store": _resolve_store(base, config.store)}
    if config.buckets.grid is not None:
        grid_path = _resolve(base, config.buckets.grid)
        grid = load_grid(grid_path)
        update["buckets"] = config.buckets.model_copy(update={"grid": grid_path})
    else:
        grid = _grid_from_inline(
            located, config.buckets.batch_sizes, config.buckets.sequence_lengths
        )
    own = config.buckets  # the config's own prefill and mixed lengths override the grid's
    if own.prefill_lengths is not None or own.mixed_lengths is not None:
        grid = _grid_from_inline(
            located,
            grid.batch_sizes,
            grid.sequence_lengths,
            grid.prefill_lengths if own.prefill_lengths is None else own.prefill_lengths,
            grid.mixed_lengths if own.mixed_lengths is None else own.mixed_lengths,
        )
    config = config.model_copy(update=update)
    _check_checkpoint(located, config.model.checkpoint)
    if config.target.backend == "neuron":
        from pipeline.plan.checkpoint import check_neuron_exportable

        check_neuron_exportable(config.model.checkpoint)
    return Release(path=path, config=config, grid=grid, source=located.data)


def load_grid(path: Path | str) -> BucketGrid:
    """Load a bucket grid file (``buckets/*.yaml``)."""
    return validate_located(load_yaml(Path(path)), BucketGrid)


def validate_located(located: Located, model: type[BaseModel]) -> Any:
    """Validate parsed YAML into ``model``; the first error becomes a ConfigError with its line."""
    if not isinstance(located.data, dict):
        raise ConfigError(
            str(located.path),
            "expected a mapping of keys at the top level",
            f"see the examples in configs/ and buckets/ for {model.__name__}",
            line=1,
        )
    try:
        return model.model_validate(located.data)
    except ValidationError as e:
        raise _config_error(located, e.errors()[0]) from None


def _config_error(located: Located, err: dict[str, Any]) -> ConfigError:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    field = ".".join(str(p) for p in loc) or None
    kind = err["type"]
    msg = err["msg"].removeprefix("Value error, ")
    hint = None
    if kind == "extra_forbidden":
        msg, hint = f"unknown key '{loc[-1]}'", "check the spelling; unknown keys are rejected"
        field = ".".join(str(p) for p in loc[:-1]) or None
    elif kind == "missing":
        hint = "add it"
    elif kind in {"int_type", "greater_than"}:
        msg, hint = f"{msg} (got {err.get('input')!r})", "use a positive whole number"
    elif kind == "literal_error":
        hint = "use one of the listed values"
    return ConfigError(str(located.path), msg, hint, line=located.line_of(loc), field=field)


def _grid_from_inline(
    located: Located,
    batch_sizes: Any,
    sequence_lengths: Any,
    prefill_lengths: Any = (),
    mixed_lengths: Any = None,
) -> BucketGrid:
    try:
        return BucketGrid(
            batch_sizes=batch_sizes,
            sequence_lengths=sequence_lengths,
            prefill_lengths=list(prefill_lengths),
            mixed_lengths=None if mixed_lengths is None else list(mixed_lengths),
        )
    except ValidationError as e:
        err = dict(e.errors()[0])
        err["loc"] = ("buckets", *err["loc"])
        raise _config_error(located, err) from None


def _check_checkpoint(located: Located, checkpoint: Path) -> None:
    if not (checkpoint / "config.json").is_file():
        raise ConfigError(
            str(located.path),
            f"checkpoint directory '{checkpoint}' has no config.json",
            "point model.checkpoint at a Hugging Face checkpoint, or create one with "
            "'inf2-pipeline tiny-model DIR'",
            line=located.line_of(("model", "checkpoint")),
            field="model.checkpoint",
        )


def _resolve(base: Path, p: Path) -> Path:
    return p if p.is_absolute() else (base / p).resolve()


def _resolve_store(base: Path, url: str) -> str:
    if "://" in url and not url.startswith("file://"):
        return url
    return str(_resolve(base, Path(url.removeprefix("file://"))))
