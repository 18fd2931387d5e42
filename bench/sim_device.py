"""A simulated accelerator for the serving engine's host side: slots that take the time a
measured device takes (sleeping, so the GIL is free as it is while a CUDA sync waits) and
return made-up tokens. ``bench/bench_engine_host.py`` serves with it to see what the host
(engine, event loop, HTTP) costs beside the device on any machine, no GPU needed.

The device is one in-order queue, as a CUDA stream is: each call is enqueued at once and
finishes ``duration`` after the later of its launch and the previous call's end; reading
its tokens waits for that. So a host that launches the next step before reading this one
keeps the device busy, and one that waits first leaves it idle while it works, exactly as
on a GPU.

Default timings: the twelfth GPU round's H200 (bench/RESULTS.md): ``Slots.step`` 0.898 /
1.130 / 1.174 ms at batch 1 / 8 / 32 (s256) and 1.188 ms at b32 × s2048; a prefill call
about 1 ms plus 2.5 µs a computed position (fits the replays' prefills-alone totals within
~20 %). A mixed call (a step with prompts packed into one stream, ``launch_mixed``) takes
a prefill call's time at the stream's length plus ``mixed_step_s`` for the step's rows in
the same pass: 0.3 ms, what the
nineteenth round's start-up timings measured on the H200 (b32_s256: one 64-token prompt
1.65-1.73 ms mixed against 1.38-1.39 ms as a prefill call alone). Tokens never end an
answer (no EOS): every request runs to its ``max_tokens``.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.contracts.bucket import Bucket, mixed_length, mixed_lengths


@dataclass(frozen=True)
class Timings:
    step_s: dict[int, float] = field(
        default_factory=lambda: {1: 0.898e-3, 8: 1.130e-3, 32: 1.174e-3}
    )
    long_step_extra_s: float = 0.014e-3  # s2048 over s256 at b32: 1.188 vs 1.174 ms
    prefill_call_s: float = 1.2e-3
    prefill_position_s: float = 2.6e-6
    prefill_batch: int = 8  # prompts one prefill call takes (cuda's PREFILL_GRAPH_PROMPTS)
    # what a step's rows add to a prefill call's pass over the weights, in a mixed call
    # (module docstring: the H200's); a negative value: no mixed calls
    mixed_step_s: float = 0.3e-3
    mixed_longest: int = 512  # cuda's default: packed streams up to this many positions

    @classmethod
    def load(cls, path: Path | None) -> Timings:
        if path is None:
            return cls()
        raw = json.loads(path.read_text())
        raw["step_s"] = {int(k): float(v) for k, v in raw.get("step_s", {}).items()} or None
        return cls(**{k: v for k, v in raw.items() if v is not None})

    def step(self, bucket: Bucket) -> float:
        """The step time of the nearest measured batch at or above the bucket's."""
        batch = min((b for b in self.step_s if b >= bucket.batch), default=max(self.step_s))
        return self.step_s[batch] + (self.long_step_extra_s if bucket.seq > 256 else 0.0)

    def prefill(self, positions: int) -> float:
        return self.prefill_call_s + self.prefill_position_s * positions


def _late_wakeup() -> float:
    """How late ``time.sleep`` wakes on this machine (median of a few short sleeps): taken off
    each wait, so the simulated sync is about as prompt as a real one."""
    late = []
    for _ in range(50):
        t = time.perf_counter()
        time.sleep(0.0005)
        late.append(time.perf_counter() - t - 0.0005)
    return sorted(late)[len(late) // 2]


class Device:
    """One in-order queue of work; ``busy_s`` is what it was given (its busy time)."""

    def __init__(self) -> None:
        self.free_at = 0.0
        # in shared memory: serve's engine runs in a process forked from the one that made
        # this device, and the server's process reports the busy time
        self._busy = multiprocessing.Value("d", 0.0, lock=False)
        self.late = _late_wakeup()
        self._lock = threading.Lock()

    @property
    def busy_s(self) -> float:
        return float(self._busy.value)

    def enqueue(self, seconds: float) -> float:
        """Launch ``seconds`` of work now; when it will be done (perf_counter time)."""
        with self._lock:
            self.free_at = max(time.perf_counter(), self.free_at) + seconds
            self._busy.value += seconds
            return self.free_at

    def wait(self, done_at: float) -> None:
        left = done_at - time.perf_counter() - self.late
        if left > 0:
            time.sleep(left)


class Pending:
    """A launched step: its tokens once the device is done with it."""

    def __init__(self, device: Device, done_at: float, tokens: list[int]) -> None:
        self._device, self._done_at, self._tokens = device, done_at, tokens

    def tokens(self) -> list[int]:
        self._device.wait(self._done_at)
        return self._tokens

    def done(self) -> bool:
        return time.perf_counter() >= self._done_at


class SimSlots:
    """One bucket as slots (``pipeline.runtime.runners.Slots``), on the simulated device."""

    def __init__(self, bucket: Bucket, device: Device, timings: Timings, vocab: int) -> None:
        self.bucket, self.device, self.timings, self.vocab = bucket, device, timings, vocab
        self.batch, self.seq = bucket.batch, bucket.seq
        # the cuda release's prefill graph lengths: 64/128/256 at s256, 256/1024/2048 above
        self.prefill_lengths = (64, 128, 256) if self.seq <= 256 else (256, 1024, self.seq)
        self.prefill_batch = timings.prefill_batch
        mixes = timings.mixed_step_s >= 0 and self.batch > 1
        self.mixed_lengths = mixed_lengths(bucket, None, timings.mixed_longest) if mixes else ()
        self.mixed_batch = min(self.prefill_batch, self.batch - 1) if self.mixed_lengths else 0
        self._next: dict[int, int] = {}  # slot in use -> its next position

    def prefill_positions(self, n: int) -> int:
        return min(x for x in (*self.prefill_lengths, self.seq) if x >= n)

    def _token(self, slot: int, position: int) -> int:
        return 3 + (slot * 7919 + position * 104729) % (self.vocab - 3)

    def launch_prefill(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]], sampling: Any = None
    ) -> Pending:
        for slot, prompt in zip(slots, prompts, strict=True):
            if slot in self._next or not 1 <= len(prompt) <= self.seq:
                raise ValueError(f"slot {slot} of {self.bucket.name}: in use or bad prompt")
            self._next[slot] = len(prompt)
        longest = max(self.prefill_positions(len(p)) for p in prompts)
        done = self.device.enqueue(self.timings.prefill(longest * len(prompts)))
        tokens = [self._token(s, len(p)) for s, p in zip(slots, prompts, strict=True)]
        return Pending(self.device, done, tokens)

    def prefill_many(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]], sampling: Any = None
    ) -> list[int]:
        return self.launch_prefill(slots, prompts, sampling).tokens()

    def prefill(self, slot: int, prompt: Sequence[int], sampling: Any = None) -> int:
        return self.prefill_many([slot], [prompt])[0]

    def launch(self, slots: Sequence[int]) -> Pending:
        for s in slots:
            if self._next.get(s, self.seq) >= self.seq:
                raise ValueError(f"slot {s} of {self.bucket.name} cannot step")
        done = self.device.enqueue(self.timings.step(self.bucket))
        out = []
        for s in slots:
            out.append(self._token(s, self._next[s]))
            self._next[s] += 1
        return Pending(self.device, done, out)

    def step(self, slots: Sequence[int]) -> list[int]:
        return self.launch(slots).tokens()

    def launch_mixed(
        self,
        slots: Sequence[int],
        prompt_slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Any = None,
    ) -> Pending:
        """A step of ``slots`` and the prompts prefilled into ``prompt_slots`` in one pass:
        a prefill call's time at the packed stream's length, plus ``mixed_step_s``."""
        total = sum(len(p) for p in prompts)
        length = mixed_length(self.mixed_lengths, total)
        if length is None or not 1 <= len(prompts) <= self.mixed_batch:
            raise ValueError(f"{len(prompts)} prompts of {total} tokens in a mixed call")
        for s in slots:
            if self._next.get(s, self.seq) >= self.seq:
                raise ValueError(f"slot {s} of {self.bucket.name} cannot step")
        for slot, prompt in zip(prompt_slots, prompts, strict=True):
            if slot in self._next or not 1 <= len(prompt) <= self.seq:
                raise ValueError(f"slot {slot} of {self.bucket.name}: in use or bad prompt")
        seconds = self.timings.prefill(length) + self.timings.mixed_step_s
        done = self.device.enqueue(seconds)
        out = []
        for s in slots:
            out.append(self._token(s, self._next[s]))
            self._next[s] += 1
        for slot, prompt in zip(prompt_slots, prompts, strict=True):
            self._next[slot] = len(prompt)
            out.append(self._token(slot, len(prompt)))
        return Pending(self.device, done, out)

    def free(self, slot: int) -> None:
        self._next.pop(slot, None)


class SimModel:
    """What ``serve`` needs of ``BucketedModel``, over ``SimSlots``: the tokenizer and
    vocabulary of a checkpoint directory (``pipeline.tiny_model``'s), the given buckets."""

    def __init__(self, checkpoint: Path, buckets: Sequence[Bucket], timings: Timings) -> None:
        self.dir = checkpoint
        config = json.loads((checkpoint / "config.json").read_text())
        self._vocab = int(config["vocab_size"])
        self.manifest = SimpleNamespace(model=checkpoint.name, version="sim")
        self.device = "sim"
        self.buckets = sorted(buckets)
        self.max_seq = max(b.seq for b in self.buckets)
        self.max_batch = max(b.batch for b in self.buckets)
        self.eos_token_ids: tuple[int, ...] = ()  # answers end at max_tokens
        self.eos_token_id = None
        self.sim = Device()
        self._slots = {b: SimSlots(b, self.sim, timings, self._vocab) for b in self.buckets}

    def vocab_size(self) -> int:
        return self._vocab

    def tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens - 1  # cpu/cuda's rule: the last token needs no slot

    def warmup(self) -> None:
        pass

    def warm_buckets(self) -> list[Bucket]:
        return list(self.buckets)

    def slots(self, bucket: Bucket) -> SimSlots:
        return self._slots[bucket]
