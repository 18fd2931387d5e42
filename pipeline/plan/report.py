"""``plan``: the bucket grid, the GQA plan and the HBM budget of a release, before compiling."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.contracts import backend_table
from pipeline.contracts.bucket import Bucket, mixed_lengths, prefill_lengths
from pipeline.errors import PlanError
from pipeline.plan.checkpoint import ModelShape, read_shape
from pipeline.plan.config import DTYPE_BYTES, Release
from pipeline.plan.gqa import GqaPlan, plan_gqa
from pipeline.plan.instances import INSTANCES, Instance
from pipeline.plan.memory import BucketMemory, Residency, bucket_memory, residency


@dataclass(frozen=True)
class TpOption:
    tp: int
    strategy: str
    wasted_attention_fraction: float
    bytes_per_core: int  # weights + the largest bucket's KV cache


@dataclass(frozen=True)
class ReleasePlan:
    release: Release
    shape: ModelShape
    instance: Instance
    gqa: GqaPlan
    weight_bytes_per_core: int
    buckets: list[BucketMemory]
    resident: Residency  # every bucket loaded at once
    tp_options: list[TpOption]  # degrees that fit, least padding first, then larger tp

    def prefill_lengths(self, bucket: Bucket) -> tuple[int, ...]:
        """The prompt lengths the bucket prefills at: the grid's shorter prefill lengths on
        cpu/cuda; on neuron only the export's own (optimum-neuron pads every prefill to it)."""
        if self.release.config.target.backend in ("cpu", "cuda"):
            return prefill_lengths(bucket, self.release.grid.prefill_lengths)
        return (bucket.seq,)

    def mixed_lengths(self, bucket: Bucket) -> tuple[int, ...]:
        """The packed stream lengths the bucket's mixed calls take (a step and prompts in
        one call; cpu/cuda): the grid's, or the backend's default up to a length."""
        backend = self.release.config.target.backend
        if backend not in ("cpu", "cuda"):
            return ()
        return mixed_lengths(
            bucket,
            self.release.grid.mixed_lengths,
            backend_table.mixed_longest(backend),
        )

    @property
    def all_fit(self) -> bool:
        return all(b.fits for b in self.buckets)

    def to_dict(self) -> dict:
        return {
            "model": self.release.name,
            "checkpoint": str(self.release.checkpoint),
            "instance": {
                "type": self.instance.name,
                "neuron_cores": self.instance.cores,
                "hbm_per_core_bytes": self.instance.hbm_per_core,
            },
            "gqa": self.gqa.to_dict(),
            "weight_bytes_per_core": self.weight_bytes_per_core,
            "buckets": [
                {
                    "name": m.bucket.name,
                    "batch": m.bucket.batch,
                    "seq": m.bucket.seq,
                    "prefill_lengths": list(self.prefill_lengths(m.bucket)),
                    "mixed_lengths": list(self.mixed_lengths(m.bucket)),
                    "kv_cache_bytes_per_core": m.kv_cache_bytes,
                    "total_bytes_per_core": m.total_bytes,
                    "fits": m.fits,
                }
                for m in self.buckets
            ],
            "all_fit": self.all_fit,
            "resident": {
                "weights_per_bucket": self.resident.weights_per_bucket,
                "total_bytes_per_core": self.resident.total_bytes,
                "fits": self.resident.fits,
                "max_loaded_buckets": self.resident.max_loaded,
            },
            "tp_options": [o.__dict__ for o in self.tp_options],
        }


def release_gqa_plan(release: Release, shape: ModelShape | None = None) -> GqaPlan:
    """The GQA plan of a release config: what compile applies and the manifest records."""
    shape = shape or read_shape(release.checkpoint)
    cfg = release.config
    return plan_gqa(
        shape.q_heads,
        shape.kv_heads,
        cfg.target.tp_degree,
        cfg.target.gqa_strategy,
        head_dim=shape.head_dim,
        layers=shape.layers,
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype],
    )


def plan_release(release: Release) -> ReleasePlan:
    cfg = release.config
    shape = read_shape(release.checkpoint)
    instance = INSTANCES[cfg.target.instance_type]
    tp = cfg.target.tp_degree
    if tp > instance.cores:
        raise PlanError(
            f"{release.path}: target.tp_degree",
            f"tp {tp} exceeds the {instance.cores} NeuronCores of {instance.name}",
            f"use tp ≤ {instance.cores} or a larger instance",
        )
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    gqa = release_gqa_plan(release, shape)
    weights, rows = bucket_memory(shape, gqa, release.buckets, dtype_bytes, instance.hbm_per_core)
    # Only cpu/cuda releases share one weights copy among buckets; neuron (and auto, whose
    # first choice is neuron) loads one per bucket.
    shared = cfg.target.backend in ("cpu", "cuda")
    return ReleasePlan(
        release=release,
        shape=shape,
        instance=instance,
        gqa=gqa,
        weight_bytes_per_core=weights,
        buckets=rows,
        resident=residency(weights, rows, instance.hbm_per_core, weights_per_bucket=not shared),
        tp_options=tp_options(shape, release, instance, dtype_bytes),
    )


def tp_options(
    shape: ModelShape, release: Release, instance: Instance, dtype_bytes: int
) -> list[TpOption]:
    """Degrees that tile the instance's cores and fit every bucket, least padding first."""
    options = []
    for tp in (t for t in range(1, instance.cores + 1) if instance.cores % t == 0):
        gqa = plan_gqa(shape.q_heads, shape.kv_heads, tp)
        _, rows = bucket_memory(shape, gqa, release.buckets, dtype_bytes, instance.hbm_per_core)
        if all(r.fits for r in rows):
            worst = max(r.total_bytes for r in rows)
            options.append(TpOption(tp, gqa.strategy, gqa.wasted_attention_fraction, worst))
    # Least padding first; among equals the larger degree (lower latency per token).
    return sorted(options, key=lambda o: (o.wasted_attention_fraction, -o.tp))
