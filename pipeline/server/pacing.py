"""When the engine launches an iteration under overlap: shortly before the device runs out of
queued work, not as soon as the host has read the last tokens (``serve --launch-lead``).

Under overlap the engine queues iteration j+1's calls while the device still runs iteration
j's, so the device never waits for the host. Launched at once, j+1 is fixed a whole device
iteration before the device reaches it: a request that arrives while j runs joins j+2, and
its first token comes two iterations after its arrival's. Held until the device's queued work
is about to end, the launch takes every request that arrived meanwhile, and the device is as
busy as before: a request waits for the iteration that is running, then its own.

When the queued work ends is predicted: it started when the host's last read that had to
wait for the device returned (the device had just finished the call before it), and it takes
what the start-up timings say its calls take (a step, a mixed call: ``prefill_costs``),
scaled by what the device took against that prediction lately (a step attends a longer cache
as rows grow, the timings were taken at short ones). The launch comes ``lead`` before it:
the host's own work between waking and the device having the call (placing, launching,
the clock's late wake-ups). The lead adapts: a launch that finds the device done already (it
idled) widens the lead by half, each one in time narrows it by 2 %, so about one launch in
twenty is late, by little.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MIN_LEAD_S = 0.1e-3
MAX_LEAD_S = 5e-3
WIDEN, NARROW = 1.5, 0.98  # the lead after a late launch, after one in time
SCALE_WEIGHT = 0.1  # of each new measurement in the prediction's scale
SCALE_RANGE = (0.5, 2.0)


def done(pending: Any) -> bool:
    """Whether the call's work is finished (a pending without ``done``: taken as finished,
    so it never holds a launch back on a guess)."""
    check = getattr(pending, "done", None)
    return True if check is None else bool(check())


@dataclass
class Pacer:
    """The launch clock of one engine. ``cost(call)``: a launched call's predicted device
    seconds, None where nothing was timed for it (then the launch is not held). ``lead_s``:
    the lead to start from; ``adapt``: let launches that come late or in time move it."""

    cost: Callable[[Any], float | None]
    lead_s: float = 0.5e-3
    adapt: bool = True
    clock: Callable[[], float] = time.perf_counter
    scale: float = 1.0
    late: int = 0  # launches that found the device done
    in_time: int = 0
    _free_at: float | None = None  # when the device is predicted to run out of work
    _started: float | None = None  # when the device started the queued calls, if seen
    _predicted: float = 0.0  # their predicted seconds (unscaled)
    _synced: float | None = None  # this iteration's last read that waited for the device
    _last: Any = None  # the last queued call's pending: its read ends what was predicted
    _ended: float | None = None  # when that read, having waited, returned
    ratios: list[float] = field(default_factory=list)  # measured / predicted, lately

    def until(self) -> float | None:
        """When the next launch is due (host clock), or None: launch at once."""
        return None if self._free_at is None else self._free_at - self.lead_s

    def launching(self, inflight: Sequence[Any]) -> bool | None:
        """The iteration is about to launch: whether the device had already finished what
        was queued (late), which moves the lead; None where nothing was held."""
        if self._free_at is None or not inflight:
            return None
        late = done(inflight[-1].pending)
        if late:
            self.late += 1
            if self.adapt:
                self.lead_s = min(MAX_LEAD_S, self.lead_s * WIDEN + MIN_LEAD_S / 2)
        else:
            self.in_time += 1
            if self.adapt:
                self.lead_s = max(MIN_LEAD_S, self.lead_s * NARROW)
        return late

    def read(self, pending: Any, read: Callable[[], Any]) -> Any:
        """``read()`` (a call's tokens), noting when a read that waited for the device
        returned: the device had just finished this call and started the next."""
        waits = not done(pending)
        out = read()
        if waits:
            self._synced = self.clock()
            if pending is self._last:
                self._ended = self._synced
        return out

    def queued(self, calls: Sequence[Any], launched_at: float) -> None:
        """The iteration's reads are over; ``calls`` (launched at ``launched_at``) are what
        the device runs now, read at the next iteration. Predict when it runs out."""
        # what the device took for the last iteration's calls, where both ends were seen
        if self._started is not None and self._ended is not None and self._predicted:
            took = self._ended - self._started
            if took > 0:
                ratio = took / self._predicted
                self.ratios = [*self.ratios[-63:], ratio]
                lo, hi = SCALE_RANGE
                mixed = (1 - SCALE_WEIGHT) * self.scale + SCALE_WEIGHT * ratio
                self.scale = min(hi, max(lo, mixed))
        costs = [self.cost(c) for c in calls]
        # nothing timed to predict by, or nothing left running (a device whose launch
        # returns when the call is done: cpu): launch at once
        if not calls or any(c is None for c in costs) or done(calls[-1].pending):
            self._free_at = self._started = None
            self._predicted = 0.0
        else:
            self._predicted = sum(c for c in costs if c is not None)
            # a read that waited: the device went on to these calls then; none did: it was
            # idle when they were launched
            self._started = self._synced
            start = self._synced if self._synced is not None else launched_at
            self._free_at = start + self.scale * self._predicted
        self._last = calls[-1].pending if calls else None
        self._synced = self._ended = None


def call_costs(steps: dict[Any, float], costs: dict[Any, Any]) -> Callable[[Any], float | None]:
    """A launched call's predicted seconds (``engine_calls.Launched``): a step by ``steps``
    (each bucket's, timed at start-up), a mixed call by its bucket's ``PrefillCosts``; None
    for what was not timed."""

    def cost(call: Any) -> float | None:
        bucket = call.res.bucket
        if not call.prompts:
            return steps.get(bucket)
        table = costs.get(bucket)
        if table is None:
            return None
        if call.prefill:
            return float(table(call.prompts, call.computed))
        return table.mixed_call(call.computed)  # a mixed call's computed: its stream

    return cost
