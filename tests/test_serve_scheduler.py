"""The scheduler in-process, with a fake model whose sessions can be held: grouping, bucket
choice, the bounded queue, cancellation of queued and running requests, draining."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pipeline.plan.buckets import Bucket, select_bucket
from pipeline.server.scheduler import QueueFull, Request, Scheduler, pick_group

EOS = 2


class FakeSession:
    def __init__(self, model: FakeModel, bucket: Bucket) -> None:
        self.model, self.bucket = model, bucket

    def generate(self, prompts, max_new_tokens, eos_token_id, on_tokens=None):
        self.model.calls.append((self.bucket, [list(p) for p in prompts], max_new_tokens))
        self.model.gate.wait(30)
        rows = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            if self.model.per_step is not None:
                assert self.model.per_step.acquire(timeout=30)
            step = [self.model.token(p, len(r)) for p, r in zip(prompts, rows, strict=True)]
            for r, t in zip(rows, step, strict=True):
                r.append(t)
            self.model.steps += 1
            if on_tokens is not None and on_tokens(step):
                break
        return [r[: r.index(EOS) + 1] if EOS in r else r for r in rows]


class WholeAnswerSession(FakeSession):
    def generate(self, prompts, max_new_tokens, eos_token_id):  # no on_tokens
        return super().generate(prompts, max_new_tokens, eos_token_id)


class FakeModel:
    buckets = sorted([Bucket(1, 32), Bucket(1, 64), Bucket(2, 32), Bucket(2, 64)])
    max_batch, max_seq, eos_token_id = 2, 64, EOS

    def __init__(self, session_cls=FakeSession) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list = []
        self.steps = 0
        self.per_step: threading.Semaphore | None = None  # when set, one release per step
        self.session_cls = session_cls

    @staticmethod
    def token(prompt, i: int) -> int:
        if prompt[0] == 99 and i == 2:  # prompts starting with 99 stop at their third token
            return EOS
        return 10 + (sum(prompt) + i) % 50

    def select(self, batch, seq):
        b = select_bucket(self.buckets, batch, seq)
        if b is None:
            raise ValueError("no bucket")
        return b

    def tokens_needed(self, prompt_len, max_new_tokens):
        return prompt_len + max_new_tokens - 1

    def session(self, bucket):
        return self.session_cls(self, bucket)


def req(prompt, max_tokens, steps=True) -> Request:
    need = len(prompt) + max_tokens - 1
    return Request(prompt=prompt, max_tokens=max_tokens, need=need, steps=steps)


async def drain(r: Request) -> tuple[list[int], str]:
    out: list[int] = []
    while True:
        kind, value = await asyncio.wait_for(r.events.get(), 30)
        if kind == "tokens":
            out += value
        else:
            return out, value


def run(coro_fn, model=None, **kw):
    """Run ``coro_fn(scheduler, model)`` with the worker thread going; always drained."""
    model = model or FakeModel()

    async def main():
        s = Scheduler(
            model, asyncio.get_running_loop(), **{"max_wait_s": 0.05, "max_queue": 8, **kw}
        )
        t = threading.Thread(target=s.run, daemon=True)
        t.start()
        try:
            return await coro_fn(s, model)
        finally:
            model.gate.set()
            s.close()
            await asyncio.to_thread(t.join, 30)
            assert not t.is_alive()

    return asyncio.run(main())


def test_pick_group_keeps_the_oldest_and_joins_the_closest_need():
    m = FakeModel()
    a, b, c = req([1] * 20, 5), req([1] * 40, 20), req([1] * 10, 12)  # needs 24, 59, 21
    # a + c: one run of 12 steps from a 20-token prompt needs 31 positions
    group, bucket = pick_group([a, b, c], m)
    assert group == [a, c] and bucket == Bucket(2, 32)
    group, bucket = pick_group([b, a, c], m)
    assert group[0] is b and bucket == Bucket(2, 64)
    assert pick_group([a], m) == ([a], Bucket(1, 32))


def test_group_answers_equal_alone_and_each_takes_its_own_max_tokens():
    async def body(s, m):
        rs = [req([5, 6], 3), req([7], 6), req([99, 1], 8)]
        m.gate.clear()  # hold the worker so all three are queued together
        for r in rs:
            s.submit(r)
        m.gate.set()
        return [await drain(r) for r in rs]

    out = run(body, max_wait_s=0.5)
    assert out[0] == ([FakeModel.token([5, 6], i) for i in range(3)], "length")
    assert out[1] == ([FakeModel.token([7], i) for i in range(6)], "length")
    assert out[2] == ([FakeModel.token([99, 1], 0), FakeModel.token([99, 1], 1), EOS], "stop")


def test_full_queue_refuses_and_cancel_frees_the_slot():
    async def body(s, m):
        m.gate.clear()
        running = req([1], 3)
        s.submit(running)
        while not m.calls:  # the worker took it and is held
            await asyncio.sleep(0.01)
        queued = [req([i], 3) for i in range(2)]
        for r in queued:
            s.submit(r)
        with pytest.raises(QueueFull):
            s.submit(req([9], 3))
        s.cancel(queued[0])
        assert s.depth == 1
        s.submit(late := req([8], 3))  # the freed slot takes a new request
        m.gate.set()
        await drain(running), await drain(queued[1]), await drain(late)
        return m.calls

    calls = run(body, max_queue=2)
    assert all([0] not in prompts for _, prompts, _ in calls)  # the cancelled one never ran


def test_cancelling_every_running_row_stops_the_batch_early():
    async def body(s, m):
        m.per_step = threading.Semaphore(1)  # the first step only, for now
        r = req([1, 2], 50)
        s.submit(r)
        kind, _ = await asyncio.wait_for(r.events.get(), 30)
        assert kind == "tokens"
        s.cancel(r)
        m.per_step.release(100)
        while s.running:
            await asyncio.sleep(0.01)
        return m.steps

    steps = run(body)
    assert steps < 50


def test_close_drains_what_is_queued():
    async def body(s, m):
        m.gate.clear()
        rs = [req([i + 1], 4) for i in range(5)]
        for r in rs:
            s.submit(r)
        s.close()
        m.gate.set()
        return [await drain(r) for r in rs]

    out = run(body, max_wait_s=10)
    assert all(len(tokens) == 4 for tokens, _ in out)


def test_whole_answers_run_without_per_step_tokens():
    async def body(s, m):
        a, b = req([5, 6], 3, steps=False), req([7], 6, steps=False)
        m.gate.clear()
        s.submit(a), s.submit(b)
        m.gate.set()
        return [await drain(r) for r in (a, b)], m.steps

    (a, b), steps = run(body, max_wait_s=0.5)
    assert a == ([FakeModel.token([5, 6], i) for i in range(3)], "length")
    assert b == ([FakeModel.token([7], i) for i in range(6)], "length")
    assert steps == 6  # the plain loop, for the longest request


def test_sessions_without_on_tokens_still_answer():
    async def body(s, m):
        r = req([3, 4], 5)
        s.submit(r)
        return await drain(r)

    tokens, reason = run(body, FakeModel(WholeAnswerSession))
    assert tokens == [FakeModel.token([3, 4], i) for i in range(5)] and reason == "length"


def test_text_stream_holds_back_a_possible_stop_string():
    from pipeline.server.tokenizer import TextStream

    class CharTok:  # one character per id
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    t = TextStream(CharTok(), ["END"])
    out = [t.push([ord(c)]) for c in "abcENxEND zz"]
    assert "".join(out) == "abcENx" and t.stopped
    t = TextStream(CharTok(), ["END"])
    assert "".join(t.push([ord(c)]) for c in "abEN") + t.flush() == "abEN"
