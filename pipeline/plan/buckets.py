"""Static-shape buckets: (batch size, sequence length) pairs, each compiled to its own graph."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.errors import InputError

PositiveInt = Annotated[int, Field(strict=True, gt=0)]


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    seq: int

    @property
    def name(self) -> str:
        return f"b{self.batch}_s{self.seq}"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @classmethod
    def parse(cls, name: str) -> Bucket:
        """Inverse of ``name``: ``b4_s512`` -> Bucket(4, 512)."""
        try:
            b, s = name.split("_")
            if not (b.startswith("b") and s.startswith("s")):
                raise ValueError
            return cls(int(b[1:]), int(s[1:]))
        except ValueError:
            raise InputError(
                name, "not a bucket name", "use b<batch>_s<seq>, e.g. b1_s128"
            ) from None


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


def prefill_lengths(bucket: Bucket, configured: Sequence[int] = ()) -> tuple[int, ...]:
    """The prompt lengths ``bucket`` has prefill graphs for: the configured ones below its
    sequence length, and that length itself."""
    return (*sorted({n for n in configured if n < bucket.seq}), bucket.seq)


def select_bucket(buckets: Iterable[Bucket], batch: int, seq: int) -> Bucket | None:
    """The bucket holding (batch, seq) with the fewest padded tokens, or None.

    Ties go to the smaller sequence length, then the smaller batch (cheaper decode).
    """
    best: Bucket | None = None
    for b in buckets:
        if (
            b.batch >= batch
            and b.seq >= seq
            and (best is None or (b.tokens, b.seq, b.batch) < (best.tokens, best.seq, best.batch))
        ):
            best = b
    return best


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
