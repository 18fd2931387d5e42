"""Bucket grids (`buckets/*.yaml`): every batch size × every sequence length, and writing one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    # Lengths of the packed stream in which prompts may also be prefilled inside a decode
    # step, by the bucket's mixed graph (cpu/cuda; buckets of batch ≥ 2): prompts admitted
    # into a running bucket then cost no pass over the weights of their own, and a call's
    # prompts, end to end, are padded to the shortest of these that holds them. None: the
    # backend's default (cuda: 64, 128, 192, 256, 384, 512; cpu: none); []: none.
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
    def _mixed_hold_a_prompt(cls, v: list[int] | None) -> Any:
        short = sorted(n for n in v or () if n < 2)
        if short:
            raise ValueError(
                f"mixed lengths {short} are too short; a mixed call's stream holds at least 2 "
                "positions"
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
