"""bench_pull's split of a pull's landing: its steady rate between the half and 90 % marks,
and what its head and tail took beyond that rate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_pull


def test_the_landing_splits_into_head_steady_rate_and_tail():
    phases = {"manifest": 0.02, "fetch_started": 0.1, "first_range": 0.3, "half_landed": 1.1,
              "ninety_landed": 1.9, "landed": 2.3, "installed": 2.31}  # fmt: skip
    split = bench_pull.landing_split(phases, 8_000_000_000)
    # 40 % of 8 GB in 0.8 s: 4 GB/s; at that rate half takes 1.0 s (from 0.1: no loss) and
    # the last 10 % 0.2 s (0.4 s taken: 0.2 s lost)
    assert split == pytest.approx({"steady_gb_per_s": 4.0, "head_s": 0.0, "tail_s": 0.2})


def test_no_split_without_the_marks():
    assert bench_pull.landing_split({"manifest": 0.01, "installed": 0.02}, 0) is None
    same = {"fetch_started": 0, "half_landed": 1.0, "ninety_landed": 1.0, "landed": 1.0}
    assert bench_pull.landing_split(same, 100) is None  # one range past both marks
