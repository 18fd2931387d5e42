"""The narrow boundary every compile backend implements (DESIGN.md "Compile targets").

A backend takes (model dir, bucket, plan, flags, workdir) and returns files plus metadata.
It knows nothing about stores, shards, cache keys or manifests: the runner does that.
``compile`` runs in a child process (``pipeline.compile.worker``), so a backend may block,
crash or be killed without harming the run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contracts.bucket import Bucket


@dataclass(frozen=True)
class BucketJob:
    """One bucket to compile. Plain data, so it travels to the worker as JSON."""

    model_dir: Path  # the checkpoint to compile (GQA-padded when the backend asks for it)
    bucket: Bucket
    tp: int
    gqa: dict[str, Any]  # GqaPlan.to_dict()
    dtype: str  # float32 | bfloat16 | float16
    flags: tuple[str, ...]
    auto_cast_type: str
    out_dir: Path  # empty directory for this bucket's files
    shared: dict[str, Path] = field(default_factory=dict)  # files from prepare(), by name
    instance_type: str = ""  # the config's target.instance_type (neuron: the compile target)
    # the grid's prefill lengths (``contracts.bucket.prefill_lengths`` picks a bucket's)
    prefill_lengths: tuple[int, ...] = ()
    # the grid's mixed lengths (None: the backend's default; ``Backend.mixed_lengths``)
    mixed_lengths: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            model_dir=str(self.model_dir),
            bucket=self.bucket.name,
            out_dir=str(self.out_dir),
            flags=list(self.flags),
            prefill_lengths=list(self.prefill_lengths),
            mixed_lengths=None if self.mixed_lengths is None else list(self.mixed_lengths),
            shared={k: str(v) for k, v in self.shared.items()},
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BucketJob:
        return cls(
            model_dir=Path(d["model_dir"]),
            bucket=Bucket.parse(d["bucket"]),
            tp=d["tp"],
            gqa=d["gqa"],
            dtype=d["dtype"],
            flags=tuple(d["flags"]),
            auto_cast_type=d["auto_cast_type"],
            out_dir=Path(d["out_dir"]),
            shared={k: Path(v) for k, v in d["shared"].items()},
            instance_type=d.get("instance_type", ""),
            prefill_lengths=tuple(d.get("prefill_lengths", ())),
            mixed_lengths=None if d.get("mixed_lengths") is None else tuple(d["mixed_lengths"]),
        )


@dataclass
class BucketOutput:
    """What a bucket compiled to: files by their path inside the bucket (all of them under
    ``job.out_dir``; hard-link shared files there), and facts for the cache entry."""

    files: dict[str, Path]
    meta: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    name: str
    # cpu/cuda compile the GQA-padded checkpoint; Neuron's tooling pads heads itself.
    wants_padded_checkpoint: bool = True
    # False: ``compile`` writes weight-free graphs and ``prepare`` the weights every bucket
    # binds at load time, so the graphs are cached under a key without the weights and a
    # new checkpoint of the same architecture only runs ``prepare`` (docs/finetune.md).
    # True: ``compile``'s outputs hold the weights (and the whole config.json), so they are
    # part of the graph key and every new checkpoint compiles again.
    graphs_depend_on_weights: bool = False
    # True: a bucket compiles a prefill graph per prefill length (cpu/cuda); False: the
    # backend's prefill always covers the bucket's whole length (optimum-neuron pads every
    # prefill to the export's sequence length), so the lengths stay out of its keys.
    prefill_per_length: bool = False

    def mixed_lengths(self, bucket: Bucket, configured: Sequence[int] | None) -> tuple[int, ...]:
        """The packed stream lengths ``bucket``'s mixed graph (a decode step and prompts in
        one call) is used at, given the grid's ``configured`` ones. Default:
        none (neuron: optimum-neuron's models run context encoding and token generation
        as separate graphs)."""
        return ()

    def unavailable_reason(self) -> str | None:
        """None when this backend can compile here; else one line saying what is missing."""
        return None

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Compiler and library versions that change the output (part of the cache key)."""

    def key_options(
        self, flags: tuple[str, ...] | list[str], instance_type: str | None = None
    ) -> dict[str, Any]:
        """Settings beyond the config's flags that change the output (part of the key)."""
        return {}

    def check_model(self, checkpoint: Path) -> None:
        """Raise one line (an InputError) if this backend cannot compile the checkpoint's
        architecture. Default: whatever the planner accepts."""
        return None

    def prepare(self, model_dir: Path, dtype: str, out_dir: Path) -> dict[str, Path]:
        """Make the prepared weights every bucket shares (once per release, in a worker),
        cached under the weights key. Default: none."""
        return {}

    @abstractmethod
    def compile(self, job: BucketJob) -> BucketOutput:
        """Compile one bucket into ``job.out_dir``. Runs in a child process. Unless
        ``graphs_depend_on_weights``, the outputs must not depend on the checkpoint's weights
        (they are cached under a key without them) and must not include prepare's files."""
