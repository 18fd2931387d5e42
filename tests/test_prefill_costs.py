"""``serve --prefill-merge auto``'s measurement: each bucket's prefill calls timed once."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from pipeline.server.prefill_costs import PrefillCosts, measure, prompt_counts


class TimedSlots:
    """Slots whose prefill calls advance a fake clock by a known cost, and that must be
    freed before a row is filled again."""

    def __init__(
        self, batch: int, prefill_batch: int, lengths: tuple[int, ...], per_position=1e-6
    ) -> None:
        self.batch, self.prefill_batch, self.prefill_lengths = batch, prefill_batch, lengths
        self.per_position = per_position
        self.now = 0.0
        self.used: set[int] = set()
        self.calls: list[tuple[int, int]] = []

    def clock(self) -> float:
        return self.now

    def prefill_many(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        assert not self.used & set(slots), "a row filled twice without a free"
        assert len({len(p) for p in prompts}) == 1
        self.used |= set(slots)
        self.calls.append((len(slots), len(prompts[0])))
        # the first call of a shape is slow (a graph's first run), the others exact
        first = self.calls.count(self.calls[-1]) == 1
        self.now += (
            (0.005 if first else 0.0) + 1e-3 + self.per_position * len(slots) * len(prompts[0])
        )
        return [0] * len(slots)

    def free(self, slot: int) -> None:
        self.used.discard(slot)


def test_prompt_counts_cover_every_graphed_count_then_doublings_and_the_largest():
    assert prompt_counts(1) == [1]
    assert prompt_counts(3) == [1, 2, 3]
    assert prompt_counts(8) == list(range(1, 9))
    assert prompt_counts(32) == [*range(1, 9), 16, 32]
    assert prompt_counts(24) == [*range(1, 9), 16, 24]


def test_measure_times_each_call_after_an_untimed_one_and_frees_its_rows():
    slots = TimedSlots(batch=32, prefill_batch=32, lengths=(16, 64))
    costs = measure(slots, reps=3, clock=slots.clock)
    assert costs is not None and not slots.used
    assert set(costs.seconds) == {(p, t) for t in (16, 64) for p in prompt_counts(32)}
    assert len(slots.calls) == 4 * len(costs.seconds)
    assert costs.seconds[1, 16] == pytest.approx(1e-3 + 16e-6)  # the slow first call: not counted
    assert costs.seconds[32, 64] == pytest.approx(1e-3 + 32 * 64e-6)
    # between measured counts: linear
    assert costs(12, 64) == pytest.approx((costs(8, 64) + costs(16, 64)) / 2)
    assert costs(3, 16) == costs.seconds[3, 16]
    with pytest.raises(KeyError):
        costs(1, 32)
    assert "16: 1×1.02ms" in costs.describe()
    # no call larger than the engine makes
    few = measure(TimedSlots(32, 32, (16,)), clock=slots.clock, limit=4)
    assert few is not None and sorted(few.seconds) == [(p, 16) for p in (1, 2, 3, 4)]


def test_a_slow_call_is_timed_once_and_larger_ones_at_its_length_not_at_all():
    """A device where a call is compute (a big model on cpu): start-up stays short."""
    slots = TimedSlots(batch=8, prefill_batch=8, lengths=(16, 4096), per_position=2e-5)
    costs = measure(slots, reps=3, clock=slots.clock)
    assert costs is not None
    # 4096 positions: 83 ms, over SLOW_S: one untimed call, one timed, nothing larger
    assert [k for k in costs.seconds if k[1] == 4096] == [(1, 4096)]
    assert slots.calls.count((1, 4096)) == 2
    assert costs(4, 4096) == pytest.approx(4 * costs(1, 4096))  # proportional beyond
    # 16 positions stay fast: every count timed
    assert [p for p, t in costs.seconds if t == 16] == list(range(1, 9))


def test_nothing_is_measured_where_a_call_takes_one_prompt():
    assert measure(TimedSlots(batch=8, prefill_batch=1, lengths=(16,))) is None
    assert measure(TimedSlots(batch=1, prefill_batch=8, lengths=(16,))) is None
    assert measure(SimpleNamespace(batch=8, prefill_batch=8, prefill_lengths=(16,))) is None


def test_outside_the_measured_counts_a_cost_is_proportional():
    costs = PrefillCosts({(2, 16): 2.0, (4, 16): 3.0})
    assert costs(1, 16) == 1.0 and costs(8, 16) == 6.0 and costs(3, 16) == 2.5


def test_the_counts_timed_one_by_one_are_those_cuda_graphs():
    pytest.importorskip("torch")
    from pipeline.runtime.decode_session import PREFILL_GRAPH_PROMPTS
    from pipeline.server.prefill_costs import GRAPHED_PROMPTS

    assert GRAPHED_PROMPTS == PREFILL_GRAPH_PROMPTS
