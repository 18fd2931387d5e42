"""Deterministic, cost-balanced shards of a bucket grid, identical on every machine.

Longest-processing-time first: buckets sorted by expected cost (batch × sequence, the
tokens a graph processes), largest first, ties by name; each goes to the shard with the
least cost so far, ties to the lowest index. Only the grid decides, never the machine.
"""

from __future__ import annotations

import re

from pipeline.contracts.bucket import Bucket
from pipeline.errors import InputError


def cost(bucket: Bucket) -> int:
    return bucket.batch * bucket.seq


def by_cost(buckets: list[Bucket]) -> list[Bucket]:
    """Most expensive first; ties by name, so every machine gets the same order."""
    return sorted(buckets, key=lambda b: (-cost(b), b.name))


def split(buckets: list[Bucket], count: int) -> list[list[Bucket]]:
    """All ``count`` shards, each most expensive first."""
    shards: list[list[Bucket]] = [[] for _ in range(count)]
    loads = [0] * count
    for b in by_cost(buckets):
        i = min(range(count), key=lambda j: (loads[j], j))
        shards[i].append(b)
        loads[i] += cost(b)
    return shards


def shard(buckets: list[Bucket], index: int, count: int) -> list[Bucket]:
    """The buckets of shard ``index`` (0-based) of ``count``."""
    check_shard(index, count)
    return split(buckets, count)[index]


def check_shard(index: int, count: int) -> None:
    if count < 1 or not 0 <= index < count:
        raise InputError(
            f"shard {index}/{count}",
            "index must be in 0..count-1 and count ≥ 1",
            "e.g. --shard 0/4 … --shard 3/4",
        )


def parse_shard(text: str) -> tuple[int, int]:
    """``"1/4"`` → (1, 4)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise InputError(f"--shard {text}", "not of the form I/N", "e.g. --shard 0/4")
    index, count = int(m[1]), int(m[2])
    check_shard(index, count)
    return index, count
