"""``serve --fold-prompts``: a prefill call that rides in its bucket's step (a mixed call).

The choice (``placement.fold_prompts``) is a pure function; the engine's side runs on the fake
slots of ``test_serve_engine`` with a ``launch_mixed`` added (the fake's answers depend only
on each row's own tokens, so every answer is compared with its prompt generated alone);
the start-up measurement on a fake clock. The real mixed graphs on cpu are in
``test_mixed_graphs``, the real server's answers in ``test_serve_process``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pipeline.contracts.bucket import Bucket
from pipeline.runtime.pending import RanThenFailed, Ready
from pipeline.server.jobs import Failed, Finished
from pipeline.server.metrics import Metrics
from pipeline.server.placement import fold_prompts
from pipeline.server.prefill_costs import PrefillCosts, measure
from tests.test_serve_engine import (
    BatchedSlots,
    FakePending,
    LaunchingModel,
    LaunchingSlots,
    alone,
    request,
    serve,
)

# --- the choice ------------------------------------------------------------------------------


def test_fold_prompts_packs_admitted_prompts_in_order_within_the_stream_and_the_count():
    assert fold_prompts([30, 20, 10], 64, 4, 256) == [0, 1, 2]
    assert fold_prompts([30, 40, 10, 20], 64, 4, 256) == [0, 2, 3]  # 40 does not fit past 30
    assert fold_prompts([30, 20, 10], 64, 2, 256) == [0, 1]  # at most two prompts
    assert fold_prompts([100, 20], 64, 4, 256) == [1]  # longer than the stream: apart
    assert fold_prompts([64, 20], 512, 4, 64) == [1]  # the bucket's whole length: apart
    assert fold_prompts([], 64, 4, 256) == []


def test_the_fold_saving_is_the_calls_and_the_step_apart_less_the_mixed_call():
    costs = PrefillCosts({(1, 32): 1.0}, step=0.9, mixed={32: 1.1, 64: 1.5})
    assert costs.fold_saving(1.0, 32) == pytest.approx(0.8)
    assert costs.fold_saving(2.0, 48) == pytest.approx(2.0 + 0.9 - 1.3)  # interpolated
    assert costs.mixed_call(16) == pytest.approx(1.1)  # below the shortest: the shortest's
    assert costs.mixed_call(128) == pytest.approx(3.0)  # past the longest: proportional
    assert PrefillCosts({(1, 32): 1.0}).fold_saving(1.0, 32) == float("-inf")  # unmeasured
    assert "a step 900.00ms; mixed, by stream length, 32:1100.00ms 64:1500.00ms" in costs.describe()


# --- the engine ----------------------------------------------------------------------------------


class MixingSlots(LaunchingSlots, BatchedSlots):
    """Launching slots with mixed calls of up to ``mixed_batch`` prompts packed into a
    stream of at most ``mixed_lengths``' longest, logged as ("mixed", bucket, step slots,
    prompt slots); the prompts fill their slots after the step, as on the device.
    ``failing_mixed``: raise at launch."""

    mixed_lengths = (8, 16)
    mixed_batch = 2
    prefill_batch = 2
    failing_mixed: type[Exception] | None = None  # raised at launch, before anything runs
    ran_then_failed = False  # the call runs, then raises RanThenFailed
    attempts = 0

    def launch_mixed(
        self,
        slots: Sequence[int],
        prompt_slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Any = None,
    ) -> FakePending:
        if not 1 <= len(prompts) <= self.mixed_batch or sum(map(len, prompts)) > 16:
            raise ValueError(f"{len(prompts)} prompts in a mixed call")
        if set(prompt_slots) & set(self.rows) or set(prompt_slots) & set(slots):
            raise ValueError("a prompt into a slot in use")
        self.attempts += 1
        if self.failing_mixed:
            raise self.failing_mixed("the mixed call broke")
        step = self.step(slots)
        self.model.log.append(("mixed", self.bucket.name, tuple(slots), tuple(prompt_slots)))
        first = [self.prefill(s, p) for s, p in zip(prompt_slots, prompts, strict=True)]
        if self.ran_then_failed:
            raise RanThenFailed("drawing its tokens broke")
        name = f"{self.bucket.name} mixed {self.step_calls}"
        return FakePending(self.model, name, [*step, *first], name in self.model.failing_reads)


class MixingModel(LaunchingModel):
    def slots(self, bucket: Bucket) -> MixingSlots:
        if bucket not in self._slots:
            self._slots[bucket] = MixingSlots(self, bucket)
        return self._slots[bucket]  # type: ignore[return-value]


B = Bucket(4, 64)


def mixed_calls(m: MixingModel) -> list[tuple]:
    return [e[2:] for e in m.log if e[0] == "mixed"]


def staggered(m: MixingModel, rs: list, later: list, **options: Any) -> list:
    """``rs`` admitted at once; ``later`` submitted while the model thread is held in the
    second step (their bucket running). Every answer and how it ended."""
    gate = m.hold_step(2)

    async def body(h):
        for r in rs:
            h.engine.submit(r)
        h.start()
        await h.reached(gate)
        for r in later:
            h.engine.submit(r)
        gate.open()
        return [await h.result(r) for r in [*rs, *later]]

    return serve(body, [B], m, start=False, **options)


def test_a_prompt_admitted_into_a_running_bucket_rides_in_its_step_and_answers_alone():
    m = MixingModel(prefill_lengths={B: (16,)})
    first = request(range(10, 14), 12)
    joins = [request([30 + i, 5], 6) for i in range(2)]  # prefill length 16: a mixed graph's
    out = staggered(m, [first], joins, fold="always")
    for r, (tokens, end) in zip([first, *joins], out, strict=True):
        assert tokens == alone(r.prompt, r.max_tokens) and end == Finished("length")
    mixed = mixed_calls(m)
    assert mixed and mixed[0][0] == (0,)  # the running row stepped, the prompts beside it
    assert sorted(s for call in mixed for s in call[1]) == [1, 2]
    prefilled_apart = [e for e in m.log if e[0] == "launch" and "prefill" in e[1]]
    assert len(prefilled_apart) == 1  # only the first request, into an idle bucket


def test_off_or_without_a_mixed_graph_for_the_length_prompts_prefill_apart():
    m = MixingModel(prefill_lengths={B: (16,)})
    first, join = request(range(10, 14), 10), request([30, 5], 6)
    staggered(m, [first], [join], fold="off")
    assert not mixed_calls(m)
    m = MixingModel(prefill_lengths={B: (16,)})
    first = request(range(10, 14), 10)
    long = request(range(40, 60), 6)  # 20 tokens: longer than the longest stream
    out = staggered(m, [first], [long], fold="always")
    assert not mixed_calls(m) and out[1][0] == alone(long.prompt, 6)


def test_always_folds_whatever_the_timings_say():
    dear = PrefillCosts({(1, 16): 1.0}, step=1.0, mixed={8: 2.5, 16: 2.6})
    m = MixingModel(prefill_lengths={B: (16,)})
    first, join = request(range(10, 14), 10), request([30, 5], 6)
    staggered(m, [first], [join], fold="always", call_costs={B: dear})
    assert mixed_calls(m)


def test_auto_folds_where_the_measured_mixed_call_is_cheaper():
    cheap = PrefillCosts({(1, 16): 1.0, (2, 16): 1.1}, step=1.0, mixed={8: 1.2, 16: 1.3})
    dear = PrefillCosts({(1, 16): 1.0, (2, 16): 1.1}, step=1.0, mixed={8: 2.5, 16: 2.6})
    for costs, folds in ((cheap, True), (dear, False), (None, False)):
        m = MixingModel(prefill_lengths={B: (16,)})
        first, join = request(range(10, 14), 10), request([30, 5], 6)
        options = {"call_costs": {B: costs}} if costs else {}
        out = staggered(m, [first], [join], fold="auto", **options)
        assert bool(mixed_calls(m)) is folds
        assert out[1][0] == alone(join.prompt, 6)


def test_a_prefill_stall_costs_folded_prompts_as_the_mixed_call_beyond_the_step():
    """Two short prompts join a running bucket under a stall budget of 0.5 (s, by the
    table). Folded, they cost the mixed call beyond the step (1.2 - 1.0 for both): both go
    in, in one mixed call. Costed as their prefill calls (1.0, then 0.1 more) only the first
    would; where the mixed call is dear they are not folded and go in one an iteration;
    where it was not timed (``always`` folds anyway) they are costed as prefill calls."""
    table = {(1, 16): 1.0, (2, 16): 1.1}
    cheap = PrefillCosts(table, step=1.0, mixed={8: 1.2, 16: 1.3})
    dear = PrefillCosts(table, step=1.0, mixed={8: 2.5, 16: 2.6})
    untimed = PrefillCosts(table, step=1.0)
    cases = (
        (cheap, "auto", [(1, 2)]),
        (dear, "auto", []),
        (untimed, "always", [(1,), (2,)]),
    )
    for costs, fold, calls in cases:
        m = MixingModel(prefill_lengths={B: (16,)})
        first = request(range(10, 14), 12)
        joins = [request([30 + i, 5], 6) for i in range(2)]
        out = staggered(m, [first], joins, fold=fold, call_costs={B: costs}, prefill_stall=0.5)
        for r, (tokens, _) in zip([first, *joins], out, strict=True):
            assert tokens == alone(r.prompt, r.max_tokens)
        assert [call[1] for call in mixed_calls(m)] == calls
        if not calls:  # prefilled apart, one an iteration
            apart = [e for e in m.log if e[0] == "launch" and "prefill" in e[1]]
            assert len(apart) == 3


def test_the_batch_at_a_time_baseline_never_folds():
    m = MixingModel(prefill_lengths={B: (16,)})
    rs = [request(range(40, 60), 5), request([7, 8], 5)]  # two calls: one could ride
    staggered(m, rs, [], fold="always", batching="static")
    assert not mixed_calls(m)


def test_prompts_of_one_iteration_fold_into_a_step_of_an_idle_bucket_beside_another_call():
    """Nothing running, two calls admitted together: one prefills, its row steps, and the
    other rides in that step."""
    m = MixingModel(prefill_lengths={B: (16,)})
    rs = [request(range(40, 60), 5), request([7, 8], 5)]  # prefill lengths 64 and 16
    out = staggered(m, rs, [], fold="always")
    for r, (tokens, _) in zip(rs, out, strict=True):
        assert tokens == alone(r.prompt, 5)
    assert mixed_calls(m)[0] == ((0,), (1,))


def test_nothing_folds_into_an_idle_bucket_beside_prompts_apart_that_want_one_token():
    """In an idle bucket a prompt folds only into the step of a prompt prefilled apart; one
    that ends at its first token does not step, so nothing folds (the stall budget costs
    what ``_fold_choice`` says, so it must say what the launch does)."""
    from pipeline.server.engine import Engine

    m = MixingModel(prefill_lengths={B: (16,)})
    engine = Engine(m, [B], None, deliver=lambda out: None, max_queue=4, fold="always")
    res = engine._resident[0]
    short = request([7, 8], 5)
    for long_tokens, folds in ((1, False), (5, True)):
        items = [(64, request(range(40, 60), long_tokens), 0), (16, short, 1)]
        choice = engine._fold_choice(res, items, 2, None)
        assert (choice is not None) is folds
        if folds:
            assert choice[1] == [items[1]]


def test_a_mixed_call_that_raises_at_launch_runs_apart_and_its_bucket_folds_no_more(caplog):
    m = MixingModel(prefill_lengths={B: (16,)})
    m.slots(B).failing_mixed = ValueError
    first = request(range(10, 14), 12)
    joins = [request([30, 5], 6), request([31, 5], 6)]
    gate = m.hold_step(2)
    later_gate = m.hold_step(4)

    async def body(h):
        h.engine.submit(first)
        h.start()
        await h.reached(gate)
        h.engine.submit(joins[0])
        gate.open()
        await h.reached(later_gate)
        h.engine.submit(joins[1])  # the bucket still runs: it could fold, and does not try
        later_gate.open()
        return [await h.result(r) for r in [first, *joins]]

    out = serve(body, [B], m, start=False, fold="always")
    for r, (tokens, end) in zip([first, *joins], out, strict=True):
        assert tokens == alone(r.prompt, r.max_tokens) and end == Finished("length")
    assert m.slots(B).attempts == 1
    assert sum("it folds no more" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("overlap", [True, False])
def test_a_mixed_call_whose_tokens_cannot_be_read_fails_the_rows_it_held_only(overlap):
    m = MixingModel(prefill_lengths={B: (16,)})
    first, join = request(range(10, 14), 30), request([30, 5], 6)
    m.failing_reads.add(f"{B.name} mixed 3")  # steps 1 and 2 before the join: it rides in 3
    after = request([50, 5], 4)
    gate = m.hold_step(2)

    async def body(h):
        h.engine.submit(first)
        h.start()
        await h.reached(gate)
        h.engine.submit(join)
        gate.open()
        got = [await h.result(first), await h.result(join)]
        h.engine.submit(after)  # the server lives on
        return [*got, await h.result(after)]

    out = serve(body, [B], m, start=False, fold="always", overlap=overlap)
    assert isinstance(out[0][1], Failed) and isinstance(out[1][1], Failed)
    assert "the device failed" in out[1][1].message
    assert out[2] == (alone(after.prompt, 4), Finished("length"))
    assert len(mixed_calls(m)) == 1  # not run again apart


def test_a_mixed_call_that_ran_then_failed_fails_its_rows_and_is_not_run_again():
    m = MixingModel(prefill_lengths={B: (16,)})
    m.slots(B).ran_then_failed = True
    first, join = request(range(10, 14), 30), request([30, 5], 6)
    out = staggered(m, [first], [join], fold="always")
    assert isinstance(out[0][1], Failed) and isinstance(out[1][1], Failed)
    assert "drawing its tokens broke" in out[1][1].message
    assert len(mixed_calls(m)) == 1 and m.slots(B).attempts == 1


def test_folded_prefills_are_counted_apart_and_with_every_prefill():
    m = MixingModel(prefill_lengths={B: (16,)})
    metrics = Metrics()
    first = request(range(10, 14), 12)
    joins = [request([30 + i, 5], 4) for i in range(2)]
    staggered(m, [first], joins, fold="always", hooks=metrics)
    folded = sum(len(c[1]) for c in mixed_calls(m))
    sample = metrics.registry.get_sample_value
    assert sample("inf2_serve_prefills_folded_total", {"bucket": B.name}) == folded >= 1
    assert sample("inf2_serve_prefills_total", {"bucket": B.name}) == 3
    steps = sample("inf2_serve_steps_total", {"bucket": B.name})
    assert steps == len([e for e in m.log if e[0] == "step"])


# --- the start-up measurement ----------------------------------------------------------------


class ClockedSlots:
    """Slots whose calls advance a fake clock: a step 1 ms, a prefill 1 ms + 10 µs a
    position, a mixed call the step + 20 µs a stream position; rows must be freed before
    they are filled again."""

    batch, seq, prefill_batch, prefill_lengths = 4, 16, 4, (8, 16)
    mixed_lengths, mixed_batch = (8, 24), 3

    def __init__(self) -> None:
        self.now, self.used = 0.0, set()
        self.mixed: list[tuple[int, int]] = []

    def clock(self) -> float:
        return self.now

    def _fill(self, slots: Sequence[int]) -> None:
        assert not self.used & set(slots), "a row filled twice without a free"
        self.used |= set(slots)

    def prefill(self, slot: int, prompt: Sequence[int]) -> int:
        return self.prefill_many([slot], [prompt])[0]

    def prefill_many(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        self._fill(slots)
        self.now += 1e-3 + 1e-5 * len(slots) * len(prompts[0])
        return [0] * len(slots)

    def step(self, slots: Sequence[int]) -> list[int]:
        assert set(slots) <= self.used
        self.now += 1e-3
        return [0] * len(slots)

    def launch_mixed(self, slots, prompt_slots, prompts) -> Any:
        assert set(slots) <= self.used and 0 not in prompt_slots
        self._fill(prompt_slots)
        assert all(len(p) < self.seq for p in prompts)
        self.mixed.append((len(prompts), sum(map(len, prompts))))
        self.now += 1e-3 + 2e-5 * sum(map(len, prompts))
        return Ready([0] * (len(slots) + len(prompts)))

    def free(self, slot: int) -> None:
        self.used.discard(slot)


def test_measure_times_a_step_and_each_mixed_call_and_frees_every_row():
    slots = ClockedSlots()
    costs = measure(slots, reps=3, clock=slots.clock)
    assert costs is not None and not slots.used
    assert costs.step == pytest.approx(1e-3)
    assert sorted(costs.mixed) == [8, 24]  # 24: two prompts of 12, each under the bucket's 16
    assert costs.mixed[24] == pytest.approx(1e-3 + 24 * 2e-5)
    assert (2, 24) in slots.mixed
    assert costs.fold_saving(costs(2, 8), 8) == pytest.approx(costs(2, 8) + 1e-3 - costs.mixed[8])
    # limited to the largest call the engine makes: one prompt cannot fill 24
    few = measure(ClockedSlots(), clock=slots.clock, limit=1)
    assert few is not None and sorted(few.mixed) == [8]
