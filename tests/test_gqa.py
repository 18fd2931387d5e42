import pytest

from pipeline.errors import PlanError
from pipeline.plan.gqa import plan_gqa


def _summary(p):
    return (
        p.strategy,
        p.padded_q_heads,
        p.padded_kv_heads,
        p.kv_replication,
        p.q_heads_per_rank,
        p.kv_heads_per_rank,
        p.q_padding,
    )


@pytest.mark.parametrize(
    ("q", "kv", "tp", "strategy", "expected", "waste"),
    [
        # Llama-3-8B shapes (32/8)
        (32, 8, 2, "auto", ("none", 32, 8, 1, 16, 4, "none"), 0.0),
        (32, 8, 8, "auto", ("none", 32, 8, 1, 4, 1, "none"), 0.0),
        (32, 8, 24, "auto", ("replicate_to_tp_degree", 48, 24, 3, 2, 1, "interleaved"), 16 / 48),
        (32, 8, 32, "auto", ("replicate_to_tp_degree", 32, 32, 4, 1, 1, "none"), 0.0),
        # Qwen2.5-14B-like 40/8 at tp 32
        (40, 8, 32, "auto", ("replicate_to_tp_degree", 64, 32, 4, 2, 1, "interleaved"), 24 / 64),
        # 32/8 at tp 12 cannot replicate: MHA, both padded at the tail to 36
        (32, 8, 12, "convert_to_mha", ("convert_to_mha", 36, 36, 4, 3, 3, "tail"), 4 / 36),
        (32, 8, 12, "auto", ("convert_to_mha", 36, 36, 4, 3, 3, "tail"), 4 / 36),
        # 64/8 at tp 12: each KV head repeated 8 times (64), then padded to 72
        (64, 8, 12, "auto", ("convert_to_mha", 72, 72, 8, 6, 6, "tail"), 8 / 72),
        # tp 1 never pads
        (8, 2, 1, "auto", ("none", 8, 2, 1, 8, 2, "none"), 0.0),
        # the tiny model at tp 4: replicate 2 KV heads twice
        (8, 2, 4, "auto", ("replicate_to_tp_degree", 8, 4, 2, 2, 1, "none"), 0.0),
        # MHA forced where replication would have worked
        (8, 2, 4, "convert_to_mha", ("convert_to_mha", 8, 8, 4, 2, 2, "none"), 0.0),
    ],
)
def test_worked_examples(q, kv, tp, strategy, expected, waste):
    p = plan_gqa(q, kv, tp, strategy)
    assert _summary(p) == expected
    assert p.wasted_attention_fraction == pytest.approx(waste)


def test_kv_cache_bytes_per_token_counts_replicated_heads():
    # Llama-3-8B at tp 24: 24 KV heads × 128 × 2 (K,V) × 32 layers × 2 bytes
    p = plan_gqa(32, 8, 24, head_dim=128, layers=32, dtype_bytes=2)
    assert p.kv_cache_bytes_per_token == 32 * 2 * 24 * 128 * 2
    assert (
        plan_gqa(32, 8, 8, head_dim=128, layers=32).kv_cache_bytes_per_token == 32 * 2 * 8 * 128 * 2
    )


@pytest.mark.parametrize(
    ("q", "kv", "tp"),
    [(32, 8, 24), (40, 8, 32), (32, 8, 12), (28, 4, 8), (16, 8, 6), (8, 2, 3), (8, 2, 16)],
)
def test_slot_maps_keep_each_query_with_its_kv_head(q, kv, tp):
    p = plan_gqa(q, kv, tp)
    qs, kvs = p.q_slot_sources(), p.kv_slot_sources()
    assert len(qs) == p.padded_q_heads and len(kvs) == p.padded_kv_heads
    assert sorted(h for h in qs if h is not None) == list(range(q))
    per_kv = p.padded_q_heads // p.padded_kv_heads
    for slot, head in enumerate(qs):
        if head is not None:
            # the KV slot this query slot attends with holds the query's original KV head
            assert kvs[slot // per_kv] == head // (q // kv)
    # every rank holds whole heads: its query slots only use its own KV slots
    for rank in range(tp):
        q_slots = range(rank * p.q_heads_per_rank, (rank + 1) * p.q_heads_per_rank)
        kv_slots = set(range(rank * p.kv_heads_per_rank, (rank + 1) * p.kv_heads_per_rank))
        assert {s // per_kv for s in q_slots} <= kv_slots


def test_forced_replication_that_cannot_apply_is_an_error():
    with pytest.raises(PlanError, match="not a multiple of 8 KV heads"):
        plan_gqa(32, 8, 12, "replicate_to_tp_degree")


@pytest.mark.parametrize(
    ("q", "kv", "tp", "match"),
    [
        (30, 8, 2, "do not divide"),
        (32, 8, 0, "≥ 1"),
        (0, 8, 2, "≥ 1"),
        (32, 0, 2, "≥ 1"),
    ],
)
def test_bad_numbers(q, kv, tp, match):
    with pytest.raises(PlanError, match=match):
        plan_gqa(q, kv, tp)
