"""bench/sim_device.py, the simulated device bench_engine_host.py serves on: its queue runs
work in order like a CUDA stream (so a host that launches ahead keeps it busy), and its
slots refuse the calls real slots refuse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from sim_device import Device, SimSlots, Timings

from pipeline.contracts.bucket import Bucket


def test_the_queue_runs_work_in_order_after_the_previous_ends():
    d = Device()
    first = d.enqueue(0.5)
    second = d.enqueue(0.25)  # launched before the first ends: it starts when the first ends
    assert second - first == pytest.approx(0.25)
    assert d.busy_s == pytest.approx(0.75)


def test_sim_slots_step_their_rows_and_refuse_what_real_slots_refuse():
    slots = SimSlots(Bucket(2, 8), Device(), Timings(step_s={1: 1e-4}, prefill_call_s=1e-4), 64)
    first = slots.prefill(0, [5, 6, 7])
    assert 3 <= first < 64 and slots.prefill_positions(3) == 8
    pending = slots.launch([0])
    assert pending.tokens() == [slots._token(0, 3)]
    with pytest.raises(ValueError, match="in use"):
        slots.prefill(0, [1])
    with pytest.raises(ValueError, match="cannot step"):
        slots.step([1])  # never prefilled
    for _ in range(4):
        slots.step([0])  # positions 4..7: the bucket is full
    with pytest.raises(ValueError, match="cannot step"):
        slots.step([0])
    slots.free(0)
    assert slots.prefill(0, [1, 2]) == slots._token(0, 2)
