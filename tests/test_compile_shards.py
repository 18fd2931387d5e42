"""Shards: deterministic, cost-balanced, complete and disjoint."""

from __future__ import annotations

import pytest

from pipeline.compile.shards import by_cost, cost, parse_shard, shard, split
from pipeline.errors import InputError
from pipeline.plan.buckets import BucketGrid

GRID = BucketGrid(batch_sizes=[1, 2, 4, 8], sequence_lengths=[128, 256, 512, 1024, 2048]).buckets()


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 20, 25])
def test_shards_are_complete_disjoint_and_balanced(count):
    parts = split(GRID, count)
    names = [b.name for p in parts for b in p]
    assert sorted(names) == sorted(b.name for b in GRID) and len(set(names)) == len(names)
    loads = [sum(cost(b) for b in p) for p in parts]
    # LPT: no shard exceeds the ideal share by more than the largest single bucket.
    assert max(loads) <= sum(loads) / count + max(cost(b) for b in GRID)


def test_shards_do_not_depend_on_input_order():
    assert split(GRID, 3) == split(list(reversed(GRID)), 3)
    assert shard(GRID, 1, 3) == split(GRID, 3)[1]


def test_two_shards_split_the_demo_grid_evenly():
    demo = BucketGrid(batch_sizes=[1, 2], sequence_lengths=[32, 64]).buckets()
    assert [[b.name for b in p] for p in split(demo, 2)] == [
        ["b2_s64", "b1_s32"],
        ["b1_s64", "b2_s32"],
    ]


def test_buckets_run_most_expensive_first_ties_by_name():
    order = [b.name for b in by_cost(GRID)]
    assert order[0] == "b8_s2048"
    assert order.index("b2_s1024") < order.index("b4_s512") < order.index("b8_s256")


@pytest.mark.parametrize("text", ["3/3", "-1/2", "1", "a/b", "0/0"])
def test_bad_shard_specs_are_input_errors(text):
    with pytest.raises(InputError):
        parse_shard(text)


def test_parse_shard():
    assert parse_shard(" 2 / 5 ") == (2, 5)
