"""Bucket grids (`buckets/*.yaml`): every batch size × every sequence length, and writing one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from pipeline.contracts.bucket import Bucket

PositiveInt = Annotated[int, Field(strict=True, gt=0)]


class BucketGrid(BaseModel):
    """A grid file (``buckets/*.yaml``): every batch size × every sequence length."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_sizes: list[PositiveInt] = Field(min_length=1)
    sequence_lengths: list[PositiveInt] = Field(min_length=1)
    # Prompt lengths a bucket also compiles a prefill graph for, besides its own sequence
    # length (those below it; cpu/cuda only): a short prompt in a long bucket pays for its
    # own length. `buckets fit` fits them to a trace's prompt lengths.
    prefill_lengths: list[PositiveInt] = Field(default_factory=list)
    # Prompt lengths (of the prefill lengths and sequence lengths) whose prompts may also be
    # prefilled inside a decode step, by a mixed graph of their own (cpu/cuda; buckets of
    # batch ≥ 2): a prompt admitted into a running bucket then costs no pass over the
    # weights of its own. None: the backend's default (cuda: the prefill lengths up to 256;
    # cpu: none); []: none.
    mixed_lengths: list[PositiveInt] | None = None

    @field_validator("batch_sizes", "sequence_lengths", "prefill_lengths", "mixed_lengths")
    @classmethod
    def _no_duplicates(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        dups = sorted({x for x in v if v.count(x) > 1})
        if dups:
            raise ValueError(f"duplicate bucket sizes {dups}; list each size once")
        return sorted(v)

    @field_validator("mixed_lengths")
    @classmethod
    def _mixed_are_prefill_lengths(cls, v: list[int] | None, info: ValidationInfo) -> Any:
        # the fields above are validated first (declaration order); absent if they failed
        known = {*info.data.get("prefill_lengths", ()), *info.data.get("sequence_lengths", ())}
        unknown = sorted(set(v or ()) - known)
        if unknown:
            raise ValueError(
                f"{unknown} are not prefill or sequence lengths of this grid; a mixed graph "
                "prefills prompts of one of those lengths"
            )
        return v

    def buckets(self) -> list[Bucket]:
        return [Bucket(b, s) for b in self.batch_sizes for s in self.sequence_lengths]


def write_grid(grid: BucketGrid, path: Path, comment: str | None = None) -> None:
    """Write a grid file atomically (temporary name, then rename)."""
    from pipeline._files import atomic_write_text

    lines = [f"# {c}" for c in (comment or "").splitlines() if c] + [
        f"batch_sizes: {list(grid.batch_sizes)}",
        f"sequence_lengths: {list(grid.sequence_lengths)}",
    ]
    if grid.prefill_lengths:
        lines.append(f"prefill_lengths: {list(grid.prefill_lengths)}")
    if grid.mixed_lengths is not None:
        lines.append(f"mixed_lengths: {list(grid.mixed_lengths)}")
    atomic_write_text(path, "\n".join(lines) + "\n")
