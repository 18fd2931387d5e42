"""Device memory per NeuronCore: sharded weights plus each bucket's static KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.plan.buckets import Bucket
from pipeline.plan.checkpoint import ModelShape
from pipeline.plan.gqa import GqaPlan


@dataclass(frozen=True)
class BucketMemory:
    bucket: Bucket
    kv_cache_bytes: int  # per NeuronCore
    total_bytes: int  # weights + KV cache, per NeuronCore
    fits: bool


def weight_bytes_per_core(shape: ModelShape, plan: GqaPlan, dtype_bytes: int) -> int:
    """Weights (with padded heads) split over tp ranks; every weight matrix is sharded,
    norms are replicated on every rank."""
    total = shape.param_count(plan.padded_q_heads, plan.padded_kv_heads)
    norms = (2 * shape.layers + 1) * shape.hidden
    return math.ceil((total - norms) / plan.tp) * dtype_bytes + norms * dtype_bytes


def kv_cache_bytes_per_core(
    shape: ModelShape, plan: GqaPlan, bucket: Bucket, dtype_bytes: int
) -> int:
    """batch × seq × layers × 2 (K and V) × KV heads per rank × head dim × bytes."""
    return (
        bucket.batch
        * bucket.seq
        * shape.layers
        * 2
        * plan.kv_heads_per_rank
        * shape.head_dim
        * dtype_bytes
    )


def bucket_memory(
    shape: ModelShape, plan: GqaPlan, buckets: list[Bucket], dtype_bytes: int, hbm_per_core: int
) -> tuple[int, list[BucketMemory]]:
    weights = weight_bytes_per_core(shape, plan, dtype_bytes)
    rows = []
    for b in buckets:
        kv = kv_cache_bytes_per_core(shape, plan, b, dtype_bytes)
        rows.append(BucketMemory(b, kv, weights + kv, weights + kv <= hbm_per_core))
    return weights, rows
