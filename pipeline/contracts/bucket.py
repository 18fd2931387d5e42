"""A bucket: one compiled shape, batch × sequence length, named ``b<batch>_s<seq>``; the
noun every stage shares (plan fits them, compile builds them, the manifest lists them, the
runtime and the server place requests in them)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipeline.errors import InputError


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


def prefill_lengths(bucket: Bucket, configured: Sequence[int] = ()) -> tuple[int, ...]:
    """The prompt lengths ``bucket`` has prefill graphs for: the configured ones below its
    sequence length, and that length itself."""
    return (*sorted({n for n in configured if n < bucket.seq}), bucket.seq)


# The packed stream lengths a backend's default ``mixed_lengths`` are taken from: steps of
# 64 while short (a call pads to the next one), then wider (a long call's padding is a
# small part of it). Each is a recorded CUDA graph per key tier, not a compile.
MIXED_LADDER = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def mixed_lengths(
    bucket: Bucket, configured: Sequence[int] | None, longest: int
) -> tuple[int, ...]:
    """The packed stream lengths ``bucket``'s mixed calls take (its prompts end to end,
    padded to the shortest that holds them): the ``configured`` ones, or where none are
    configured (None) ``MIXED_LADDER`` up to ``longest``, and no further than the first that
    holds a prompt in every free row (the backend's default); none in a bucket of one row,
    whose only slot is the one stepping."""
    if bucket.batch < 2:
        return ()
    if configured is not None:
        return tuple(sorted(set(configured)))
    out: list[int] = []
    for n in MIXED_LADDER:
        if n > longest or (out and out[-1] >= (bucket.batch - 1) * bucket.seq):
            break
        out.append(n)
    return tuple(out)


def mixed_length(lengths: Sequence[int], tokens: int) -> int | None:
    """The shortest of a bucket's mixed ``lengths`` (rising) that holds a stream of
    ``tokens``: what a mixed call is padded to (None: none holds it)."""
    return next((n for n in lengths if n >= tokens), None)


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
