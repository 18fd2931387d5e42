"""bench/device_timeline.py, the next GPU round's account of the device: busy time, gaps
between calls and the host's share of them, from calls stamped on the device's clock; and
bench_serve.py's ceiling step, timed with the replay's own rows in every slot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import device_timeline


def call(kind, t0, t1, start, end, rows=1):
    # kind, rows, host launch start, host launch end, device start, device end
    return [kind, rows, t0, t1, start, end]


def test_summarize_counts_busy_time_gaps_and_the_host_launching_inside_a_gap():
    timeline = {
        "calls": [
            call("prefill", 0.0, 0.001, 0.0, 0.004),  # device busy 0-4 ms
            call("step", 0.002, 0.003, 0.004, 0.006),  # queued behind it: no gap
            call("step", 0.007, 0.009, 0.009, 0.011),  # launched late: a 3 ms gap, 2 launching
        ],
        "reads": [(0.003, 0.006)],
    }
    d = device_timeline.summarize(timeline, 0.0, 0.012)
    assert d["calls"] == 3 and d["calls_by_kind"] == {"prefill": 1, "step": 2}
    assert d["device_busy_s"] == pytest.approx(0.008)
    assert d["device_busy_fraction"] == pytest.approx(0.008 / 0.012)
    assert d["busy_s_by_kind"] == pytest.approx({"prefill": 0.004, "step": 0.004})
    assert d["gaps"] == 1 and d["gap_s"] == pytest.approx(0.003)
    assert d["gap_s_host_launching_next"] == pytest.approx(0.002)
    assert d["host_in_reads_s"] == pytest.approx(0.003)


def test_summarize_keeps_to_its_window():
    timeline = {
        "calls": [
            call("step", 0.0, 0.001, 0.0, 0.002),  # before the window: left out
            call("step", 0.010, 0.011, 0.010, 0.012),
            call("step", 0.011, 0.012, 0.012, 0.016),  # runs past the window's end: cut there
        ],
        "reads": [],
    }
    d = device_timeline.summarize(timeline, 0.005, 0.014)
    assert d["calls"] == 2
    assert d["device_busy_s"] == pytest.approx(0.004)
    assert device_timeline.summarize(timeline, 0.1, 0.2) == {"calls": 0}


def test_the_dump_of_an_engine_loads_back_in_device_order(tmp_path):
    (tmp_path / "timeline-2.json").write_text(
        '{"calls": [["step", 1, 0.0, 0.0, 0.5, 0.6]], "reads": []}'
    )
    (tmp_path / "timeline-1.json").write_text(
        '{"calls": [["step", 1, 0.0, 0.0, 0.1, 0.2]], "reads": [[0.1, 0.2]]}'
    )
    got = device_timeline.load(tmp_path)
    assert [c[4] for c in got["calls"]] == [0.1, 0.5] and got["reads"] == [[0.1, 0.2]]


def test_install_does_nothing_without_its_variable(monkeypatch):
    from pipeline.runtime.session_slots import SessionSlots

    monkeypatch.delenv(device_timeline.ENV, raising=False)
    before = SessionSlots.launch
    device_timeline.install()
    assert SessionSlots.launch is before


class _Slots:
    """Slots that record which rows each step held (and no device)."""

    def __init__(self, batch: int) -> None:
        self.batch, self.seq = batch, 64
        self.held: dict[int, int] = {}  # slot -> prompt length
        self.steps: list[list[int]] = []

    def prefill(self, slot, prompt):
        assert slot not in self.held
        self.held[slot] = len(prompt)
        return 1

    def step(self, rows):
        assert sorted(rows) == sorted(self.held)
        self.steps.append(list(rows))
        return [1] * len(rows)

    def free(self, slot):
        del self.held[slot]


class _Model:
    device = "cpu"

    def __init__(self, batch: int) -> None:
        self._slots = _Slots(batch)

    def slots(self, bucket):
        return self._slots

    def tokens_needed(self, prompt_len, max_new_tokens):
        return prompt_len + max_new_tokens - 1


def test_the_ceilings_step_is_timed_only_with_every_slot_held_by_the_replays_rows():
    import bench_serve

    from pipeline.contracts.bucket import Bucket

    model = _Model(2)
    # answers of 3, 2, 4 and 2 tokens: the prefill gives the first, each step one more
    work = [([5] * 10, 3), ([5] * 20, 2), ([5] * 30, 4), ([5] * 99, 9)]  # the last fits no s64
    got = bench_serve.replay_decode(model, Bucket(2, 64), work, answers=[3, 2, 4, 9])
    slots = model._slots
    # rows 0 and 1 (prompts 10, 20) step once together; the second is done, its slot takes
    # the third request (prompt 30), both step once more; then the first is done and the
    # replay has nothing left to refill with: the rest would step one row, and is not timed
    assert got["steps"] == 2 == len(slots.steps)
    assert all(len(rows) == 2 for rows in slots.steps)
    assert got["batch"] == 2 and got["seq"] == 64 and got["step_ms"] > 0
    assert slots.held == {}  # every slot freed


def test_the_ceilings_step_says_so_when_the_replay_never_fills_the_bucket():
    import bench_serve

    from pipeline.contracts.bucket import Bucket

    got = bench_serve.replay_decode(_Model(4), Bucket(4, 64), [([5] * 10, 3)], answers=[3])
    assert "error" in got
