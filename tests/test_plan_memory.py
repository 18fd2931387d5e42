from pathlib import Path

import pytest

from pipeline.contracts.bucket import Bucket
from pipeline.plan.checkpoint import read_shape
from pipeline.plan.config import load_config
from pipeline.plan.gqa import plan_gqa
from pipeline.plan.memory import kv_cache_bytes_per_core, weight_bytes_per_core
from pipeline.plan.report import plan_release

REPO = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30


def test_llama3_8b_parameter_count_matches_published():
    shape = read_shape(REPO / "models/llama-3-8b")
    assert shape.param_count() == 8_030_261_248  # the published size of Meta-Llama-3-8B
    assert read_shape(REPO / "models/qwen2.5-7b").param_count() == 7_615_616_512


def test_memory_arithmetic_by_hand():
    shape = read_shape(REPO / "models/llama-3-8b")
    plan = plan_gqa(32, 8, 8)
    # 1 × 4096 × 32 layers × 2 × 1 KV head per rank × 128 × 2 bytes = 64 MiB
    assert kv_cache_bytes_per_core(shape, plan, Bucket(1, 4096), 2) == 64 * MiB
    assert kv_cache_bytes_per_core(shape, plan, Bucket(8, 2048), 2) == 256 * MiB
    norms = (2 * 32 + 1) * 4096
    expected = -(-(8_030_261_248 - norms) // 8) * 2 + norms * 2
    assert weight_bytes_per_core(shape, plan, 2) == expected
    # at tp 24 the 16 padded query heads add q_proj rows and o_proj columns on every layer
    extra = 32 * (2 * 4096 * 16 * 128 + 2 * 4096 * 16 * 128)
    assert shape.param_count(48, 24) - shape.param_count() == extra


def test_plan_flags_buckets_that_do_not_fit(write_config, tmp_path):
    cfg = write_config(f"""
        model: {{name: big, checkpoint: {REPO / "models/llama-3-8b"}, dtype: bf16}}
        target: {{instance_type: inf2.8xlarge, tp_degree: 1}}
        buckets: {{batch_sizes: [1, 8], sequence_lengths: [128, 4096]}}
    """)
    p = plan_release(load_config(cfg))
    fits = {m.bucket.name: m.fits for m in p.buckets}
    # 8B in bf16 is ~15 GiB: only the smallest KV caches fit in 16 GiB
    assert fits["b1_s128"] is True and fits["b8_s4096"] is False
    assert not p.all_fit
    assert [o.tp for o in p.tp_options] == [2]


def test_plan_refuses_tp_beyond_the_instance(write_config):
    from pipeline.errors import PlanError

    cfg = write_config("""
        model: {name: t, checkpoint: {ckpt}}
        target: {instance_type: inf2.xlarge, tp_degree: 4}
        buckets: {batch_sizes: [1], sequence_lengths: [32]}
    """)
    with pytest.raises(PlanError, match="exceeds the 2 NeuronCores"):
        plan_release(load_config(cfg))


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (REPO / "configs").glob("*.yaml") if p.name != "tiny-llama.yaml")
)
def test_shipped_real_configs_plan(name):
    p = plan_release(load_config(REPO / "configs" / name))
    assert p.all_fit and p.tp_options
