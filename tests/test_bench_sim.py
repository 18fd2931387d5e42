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


def test_sim_mixed_calls_step_and_prefill_in_one_call_of_their_summed_cost():
    timings = Timings(step_s={8: 1e-3}, prefill_call_s=1e-3, prefill_position_s=1e-6)
    slots = SimSlots(Bucket(8, 256), Device(), timings, 64)
    assert slots.mixed_lengths == (64, 128, 192, 256, 384, 512) and slots.mixed_batch == 7
    assert SimSlots(Bucket(1, 256), Device(), timings, 64).mixed_lengths == ()
    off = Timings(mixed_step_s=-1.0)
    assert SimSlots(Bucket(8, 256), Device(), off, 64).mixed_lengths == ()
    slots.prefill(0, [5, 6])
    busy = slots.device.busy_s
    got = slots.launch_mixed([0], [1, 2], [[1, 2, 3], [4]]).tokens()
    assert got == [slots._token(0, 2), slots._token(1, 3), slots._token(2, 1)]
    # the packed stream (4 tokens) at the shortest mixed length, 64 positions
    assert slots.device.busy_s - busy == pytest.approx(1e-3 + 64e-6 + timings.mixed_step_s)
    assert slots.step([0, 1, 2]) == [slots._token(0, 3), slots._token(1, 3), slots._token(2, 1)]
    with pytest.raises(ValueError, match="in use"):
        slots.launch_mixed([0], [1], [[7]])
    with pytest.raises(ValueError, match="mixed call"):
        slots.launch_mixed([0], [3, 4, 5, 6, 7, 1, 2, 0], [[7]] * 8)  # more than 7
