"""Bucket grids (`buckets/*.yaml`): every batch size × every sequence length, and writing one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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

    @field_validator("batch_sizes", "sequence_lengths", "prefill_lengths")
    @classmethod
    def _no_duplicates(cls, v: list[int]) -> list[int]:
        dups = sorted({x for x in v if v.count(x) > 1})
        if dups:
            raise ValueError(f"duplicate bucket sizes {dups}; list each size once")
        return sorted(v)

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
    atomic_write_text(path, "\n".join(lines) + "\n")
