"""Device memory per NeuronCore: sharded weights plus each bucket's static KV cache, and what
the buckets of a release need when they are resident together.

A neuron export carries its own weights: ``model.pt`` is traced without them and each export
writes its own ``checkpoint/weights/tp{r}_sharded_checkpoint.safetensors``, which loading
puts on the NeuronCores (optimum/neuron/models/inference/backend/pretrained_model.py:151-177,
179-215). So every loaded bucket costs its weights copy plus its KV cache, and the runtime
(``pipeline.runtime.neuron``) keeps loaded only what this arithmetic says fits. cpu/cuda
releases share one copy of the weights among their buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.contracts.bucket import Bucket
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


def bucket_cost(weights: int, kv_cache: int) -> int:
    """What one loaded neuron bucket takes per NeuronCore: its weights copy and KV cache."""
    return weights + kv_cache


@dataclass(frozen=True)
class Residency:
    total_bytes: int  # per NeuronCore with every bucket loaded at once
    fits: bool
    max_loaded: int  # buckets that can be loaded together (the smallest first)
    weights_per_bucket: bool  # each bucket carries its own weights copy (neuron)


def residency(
    weights: int, rows: list[BucketMemory], hbm_per_core: int, *, weights_per_bucket: bool
) -> Residency:
    """Per NeuronCore, every bucket resident together, and how many fit at once."""
    kvs = sorted(r.kv_cache_bytes for r in rows)
    if weights_per_bucket:
        costs = [bucket_cost(weights, kv) for kv in kvs]
        total = sum(costs)
    else:
        costs = [kvs[0] + weights, *kvs[1:]] if kvs else []
        total = weights + sum(kvs)
    loaded = used = 0
    for c in costs:
        if used + c > hbm_per_core:
            break
        used += c
        loaded += 1
    return Residency(total, total <= hbm_per_core, loaded, weights_per_bucket)
