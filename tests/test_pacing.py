"""``serve --launch-lead``: an iteration's launch held until the device's queued work is about
to end (``pipeline.server.pacing``).

The pacer's arithmetic runs on a fake clock and fake pending calls; the engine's hold on the
fake slots of ``test_serve_engine``, with a pacer whose launch time the test opens, so a
request sent during the hold is seen to join the held iteration whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.contracts.bucket import Bucket
from pipeline.server.jobs import Finished
from pipeline.server.metrics import Metrics
from pipeline.server.pacing import MAX_LEAD_S, MIN_LEAD_S, Pacer, call_costs
from pipeline.server.prefill_costs import PrefillCosts, measure_step
from tests.test_serve_engine import LaunchingModel, alone, request, serve


@dataclass
class Call:
    """A launched call as the pacer sees it (``engine_calls.Launched``'s fields)."""

    pending: Any
    prompts: int = 0
    computed: int = 0
    prefill: bool = False
    res: Any = field(default_factory=lambda: SimpleNamespace(bucket="b"))


class Device:
    """Pending calls whose ``done`` the test sets."""

    def __init__(self) -> None:
        self.finished: set[int] = set()

    def call(self, n: int, **kw: Any) -> Call:
        device = self

        class P:
            def done(self) -> bool:
                return n in device.finished

            def tokens(self) -> list[int]:
                device.finished.add(n)
                return [n]

        return Call(P(), **kw)


def clocked(pacer: Pacer, t: list[float]) -> Pacer:
    pacer.clock = lambda: t[0]
    return pacer


def test_the_launch_is_due_a_lead_before_the_queued_work_is_predicted_to_end():
    t, dev = [10.0], Device()
    p = clocked(Pacer(lambda c: 2e-3, lead_s=0.5e-3, adapt=False), t)
    assert p.until() is None  # nothing queued: launch at once
    first, second = dev.call(1), dev.call(2)
    p.queued([first], launched_at=10.0)  # the device was idle: it started at the launch
    assert p.until() == pytest.approx(10.0 + 2e-3 - 0.5e-3)
    # the next iteration: launched, then its read of the first call waits until 10.003
    assert p.launching([first]) is False  # the device still busy: in time
    t[0] = 10.003
    assert p.read(first.pending, first.pending.tokens) == [1]
    p.queued([second], launched_at=10.0015)
    assert p.until() == pytest.approx(10.003 + 2e-3 - 0.5e-3)  # from the read's return


def test_nothing_held_where_a_call_was_not_timed_or_the_device_is_done_already():
    dev = Device()
    p = Pacer(lambda c: None if c.prompts else 1e-3)
    p.queued([dev.call(1), dev.call(2, prompts=1, computed=64)], launched_at=0.0)
    assert p.until() is None  # a mixed call nobody timed: no guess
    done = dev.call(3)
    dev.finished.add(3)
    p.queued([done], launched_at=0.0)  # cpu: a launch returns when the call has run
    assert p.until() is None


def test_a_late_launch_widens_the_lead_one_in_time_narrows_it_within_bounds():
    dev = Device()
    p = Pacer(lambda c: 1e-3, lead_s=0.5e-3)
    running = dev.call(1)
    p.queued([running], launched_at=0.0)
    assert p.launching([running]) is False
    assert p.lead_s == pytest.approx(0.49e-3)
    dev.finished.add(1)
    assert p.launching([running]) is True
    assert p.lead_s == pytest.approx(0.49e-3 * 1.5 + MIN_LEAD_S / 2)
    for _ in range(40):
        p.launching([running])
    assert p.lead_s == MAX_LEAD_S and p.late == 41 and p.in_time == 1
    dev.finished.clear()
    for _ in range(400):
        p.launching([running])
    assert p.lead_s == MIN_LEAD_S
    fixed = Pacer(lambda c: 1e-3, lead_s=0.3e-3, adapt=False)
    fixed.queued([running], launched_at=0.0)
    fixed.launching([running])
    assert fixed.lead_s == 0.3e-3 and fixed.in_time == 1


def test_the_prediction_scales_to_what_the_device_took():
    """Calls that take twice their start-up timing (a step at a longer cache): the scale
    moves towards 2, so the launch comes before the device runs dry, not after."""
    t, dev = [0.0], Device()
    p = clocked(Pacer(lambda c: 1e-3, lead_s=0.2e-3, adapt=False), t)
    n = 0
    call = dev.call(n)
    p.queued([call], launched_at=0.0)
    for _ in range(40):
        n += 1
        nxt = dev.call(n)
        t[0] += 2e-3  # the read of the queued call waits 2 ms: that is what it took
        p.read(call.pending, call.pending.tokens)
        p.queued([nxt], launched_at=t[0] - 1e-3)
        call = nxt
    assert p.scale == pytest.approx(2.0, rel=0.05)
    assert p.until() == pytest.approx(t[0] + p.scale * 1e-3 - 0.2e-3)
    assert p.ratios[-1] == pytest.approx(2.0)


def test_call_costs_a_step_by_its_bucket_and_a_mixed_call_by_its_table():
    table = PrefillCosts({(1, 64): 1.4e-3}, step=1.1e-3, mixed={64: 1.7e-3, 128: 2e-3})
    cost = call_costs({"b8": 1.1e-3, "b1": 0.9e-3}, {"b8": table})
    at = SimpleNamespace
    assert cost(Call(None, res=at(bucket="b1"))) == 0.9e-3
    # a mixed call by its stream's length, whatever its prompts
    assert cost(Call(None, prompts=2, computed=128, res=at(bucket="b8"))) == 2e-3
    assert cost(Call(None, prompts=1, computed=96, res=at(bucket="b8"))) == pytest.approx(1.85e-3)
    assert cost(Call(None, prompts=1, computed=64, prefill=True, res=at(bucket="b8"))) == 1.4e-3
    assert cost(Call(None, prompts=1, computed=64, res=at(bucket="b1"))) is None
    assert cost(Call(None, res=at(bucket="b32"))) is None


def test_measure_step_times_a_step_of_row_zero_and_frees_it():
    m = LaunchingModel()
    slots = m.slots(Bucket(2, 32))
    ticks = iter(range(100))
    assert measure_step(slots, reps=3, clock=lambda: float(next(ticks))) == 1.0
    assert slots.rows == {}
    assert measure_step(m.slots(Bucket(1, 3))) is None


class Gate(Pacer):
    """A pacer that holds every launch until the test opens it; then at once."""

    def __init__(self) -> None:
        super().__init__(lambda c: 1.0, adapt=False)
        self.open = threading.Event()
        self.holding = threading.Event()

    def until(self) -> float | None:
        if self.open.is_set():
            return None
        self.holding.set()
        return float("inf")


def test_a_request_sent_while_the_launch_is_held_joins_that_iteration():
    """A runs; the engine holds its next launch; B, sent then, is prefilled in the held
    iteration, launched before A's next step, where without the hold A's step was on the
    device already."""
    m = LaunchingModel()
    gate = Gate()
    a, b = request([10, 11], 6), request([20, 21, 22], 3)

    async def body(h):
        h.engine.submit(a)
        h.start()
        await h.next(a)  # A's first token: its prefill and first step are launched
        assert await asyncio.to_thread(gate.holding.wait, 30)
        launched = [e for e in m.log if e[0] == "launch"]
        h.engine.submit(b)
        await asyncio.sleep(0.05)
        assert [e for e in m.log if e[0] == "launch"] == launched  # still held
        gate.open.set()
        with h.engine._cond:
            h.engine._cond.notify()
        out = [await h.result(r) for r in (a, b)]
        return launched, out

    launched, out = serve(body, [Bucket(2, 32)], m, start=False, pacer=gate, fold="off")
    assert out == [
        (alone(a.prompt, 6), Finished("length")),
        (alone(b.prompt, 3), Finished("length")),
    ]
    after = [e[1] for e in m.log if e[0] == "launch"][len(launched) :]
    # the held iteration: B's prefill, then A's step (with B's row from the next one on)
    assert after[0] == "b2_s32 prefill (1,)" and after[1].startswith("b2_s32 step")


def test_no_pacer_without_overlap():
    from pipeline.server.engine import Engine

    e = Engine(LaunchingModel(), [Bucket(2, 32)], None, max_queue=4, overlap=False,
               pacer=Gate(), deliver=lambda items: None)  # fmt: skip
    assert e._pacer is None


def test_a_held_launch_reaches_the_metrics_from_the_engines_process():
    """The engine's record of a held launch, replayed by the front into /metrics."""
    from pipeline.server.engine_main import Relay
    from pipeline.server.engine_process import EngineProcess

    relay = Relay(flush=lambda records: None)
    relay.launch(True, 0.75e-3)
    relay.launch(False, 0.7e-3)
    front = EngineProcess(None, None, 3, None, None)
    front.metrics = Metrics()
    front._records(relay.take())
    text = front.metrics.exposition()[0].decode()
    assert 'inf2_serve_held_launches_total{device="idle"} 1.0' in text
    assert 'inf2_serve_held_launches_total{device="busy"} 1.0' in text
    assert "inf2_serve_launch_lead_seconds 0.0007" in text
