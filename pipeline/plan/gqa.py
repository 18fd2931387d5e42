"""GQA head-padding plan for a tensor-parallel degree, following AWS NxD Inference's rules.

Each NeuronCore (rank) must hold whole heads. With Q query and KV key/value heads at degree tp:

* Q' = ceil(Q / tp) * tp query heads.
* KV % tp == 0: the KV heads already split evenly; nothing to replicate.
* else tp % KV == 0 (``replicate_to_tp_degree``): each KV head is copied tp/KV times, so
  KV' = tp, and query heads are padded *interleaved*: each KV group's real heads first, then
  zeros, so a padded head sits with the group it would have served.
* else (``convert_to_mha``): each KV head is repeated Q/KV times (KV = Q), then both Q and KV
  are padded with zero heads at the *tail* to Q'.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

from pipeline.errors import PlanError

Strategy = Literal["none", "replicate_to_tp_degree", "convert_to_mha"]
Requested = Literal["auto", "replicate_to_tp_degree", "convert_to_mha"]


@dataclass(frozen=True)
class GqaPlan:
    strategy: Strategy
    q_heads: int
    kv_heads: int
    tp: int
    padded_q_heads: int
    padded_kv_heads: int
    kv_replication: int
    q_heads_per_rank: int
    kv_heads_per_rank: int
    q_padding: Literal["none", "interleaved", "tail"]
    wasted_attention_fraction: float
    kv_cache_bytes_per_token: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def q_slot_sources(self) -> list[int | None]:
        """For each padded query slot, the original query head it holds (None = zero pad)."""
        q, kv, qp = self.q_heads, self.kv_heads, self.padded_q_heads
        if self.q_padding == "interleaved":
            group, slots = q // kv, qp // kv
            return [g * group + i if i < group else None for g in range(kv) for i in range(slots)]
        return [h if h < q else None for h in range(qp)]

    def kv_slot_sources(self) -> list[int | None]:
        """For each padded KV slot, the original KV head it copies (None = zero pad)."""
        q, kv, kvp = self.q_heads, self.kv_heads, self.padded_kv_heads
        if self.strategy == "replicate_to_tp_degree":
            return [h // self.kv_replication for h in range(kvp)]
        if self.strategy == "convert_to_mha":
            group = q // kv
            return [h // group if h < q else None for h in range(kvp)]
        return list(range(kv))


def plan_gqa(
    q_heads: int,
    kv_heads: int,
    tp: int,
    strategy: Requested = "auto",
    *,
    head_dim: int | None = None,
    layers: int | None = None,
    dtype_bytes: int | None = None,
) -> GqaPlan:
    """Plan head padding; raises PlanError for impossible inputs or forced strategies."""
    for name, value in (("heads", q_heads), ("kv-heads", kv_heads), ("tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"--{name}", f"must be a whole number ≥ 1, got {value!r}", None)
    if q_heads % kv_heads:
        raise PlanError(
            "heads",
            f"{q_heads} query heads do not divide into {kv_heads} KV heads",
            "query heads must be a multiple of KV heads",
        )
    qp = math.ceil(q_heads / tp) * tp
    if kv_heads % tp == 0:
        # Q is a multiple of KV, so Q splits evenly too: nothing to pad.
        chosen: Strategy = "none"
        kvp, rep, q_pad = kv_heads, 1, "none"
    elif strategy == "convert_to_mha" or (strategy == "auto" and tp % kv_heads):
        # Each KV head is repeated once per query head of its group (q/kv times); the
        # repeated heads are then tail-padded to qp with the query heads.
        chosen, kvp, rep = "convert_to_mha", qp, q_heads // kv_heads
        q_pad = "none" if qp == q_heads else "tail"
    elif tp % kv_heads == 0:
        chosen, kvp, rep = "replicate_to_tp_degree", tp, tp // kv_heads
        q_pad = "none" if qp == q_heads else "interleaved"
    else:
        raise PlanError(
            "--strategy replicate_to_tp_degree",
            f"tp {tp} is not a multiple of {kv_heads} KV heads, so KV heads cannot be replicated "
            "evenly",
            f"use convert_to_mha or a tp that is a multiple of {kv_heads}",
        )
    kv_bytes = None
    if head_dim is not None and layers is not None:
        kv_bytes = layers * 2 * kvp * head_dim * (dtype_bytes or 2)
    return GqaPlan(
        strategy=chosen,
        q_heads=q_heads,
        kv_heads=kv_heads,
        tp=tp,
        padded_q_heads=qp,
        padded_kv_heads=kvp,
        kv_replication=rep,
        q_heads_per_rank=qp // tp,
        kv_heads_per_rank=kvp // tp,
        q_padding=q_pad,
        wasted_attention_fraction=(qp - q_heads) / qp,
        kv_cache_bytes_per_token=kv_bytes,
    )
