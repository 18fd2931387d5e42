"""Where the device's time goes under ``serve``: CUDA events around every slot call.

Bench-only instrumentation (``bench_serve.py --device-timeline DIR``): the server is started
through ``install()``, which wraps ``SessionSlots.launch`` (a step), ``launch_prefill`` and
``launch_mixed`` (a step with prompts in it) with a timing event recorded on the stream
before and after each call, and the host's monotonic clock around the call's launch and
around each read of its tokens. When the engine stops, every call goes to
``DIR/timeline-<pid>.json``, times on the host's monotonic clock (the same in every process
of the machine). An event recorded before a call is stamped
when the device reaches it: when the work queued before it is done, or at once on an idle
device. So between one call's end event and the next call's start event the device had
nothing to do, and that is measured, not inferred from step counts and bench step times.

``summarize`` reads those files for a window of the host's clock (one way's replay): the
device's busy time and fraction, by kind of call, the gaps between calls, and how much of
the gaps the host spent launching the next call (the rest: reading tokens, delivering them,
placement; the engine's own work).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "INF2_DEVICE_TIMELINE"


def install() -> None:
    """Wrap the slot calls when ``$INF2_DEVICE_TIMELINE`` names a folder (else nothing)."""
    out = os.environ.get(ENV)
    if not out:
        return
    import torch

    from pipeline.runtime import pending
    from pipeline.runtime.session_slots import SessionSlots
    from pipeline.server.engine import Engine

    # Asked at the first call, never here: this runs in the server's process before it forks
    # the engine's, and a CUDA runtime started before a fork cannot be used after it.
    def cuda() -> bool:
        return torch.cuda.is_available()

    def event() -> Any:
        return torch.cuda.Event(enable_timing=True) if cuda() else _HostEvent()

    def sync() -> None:
        if cuda():
            torch.cuda.synchronize()

    calls: list[list[Any]] = []  # kind, rows, launch t0, t1, start event, end event
    reads: list[tuple[float, float]] = []  # host spans inside a read of tokens
    ref: list[Any] = []  # (event, host time) taken on an idle device

    def timed(fn: Any, kind: str) -> Any:
        def call(self: Any, slots: Any, *args: Any, **kw: Any) -> Any:
            if not ref:
                sync()
                e = event()
                e.record()
                e.synchronize()
                ref.append((e, time.monotonic()))
            start, end = event(), event()
            t0 = time.monotonic()
            start.record()
            got = fn(self, slots, *args, **kw)
            end.record()
            calls.append([kind, len(slots), t0, time.monotonic(), start, end])
            return got

        return call

    tokens = pending.DeviceTokens.tokens

    def read(self: Any) -> list[int]:
        t0 = time.monotonic()
        got = tokens(self)
        reads.append((t0, time.monotonic()))
        return got

    SessionSlots.launch = timed(SessionSlots.launch, "step")
    SessionSlots.launch_prefill = timed(SessionSlots.launch_prefill, "prefill")
    SessionSlots.launch_mixed = timed(SessionSlots.launch_mixed, "mixed")
    pending.DeviceTokens.tokens = read
    run = Engine.run

    def run_and_dump(self: Any) -> None:
        try:
            run(self)
        finally:
            if ref:
                sync()
                e0, h0 = ref[0]
                rows = [
                    [k, n, t0, t1, h0 + e0.elapsed_time(s) / 1e3, h0 + e0.elapsed_time(e) / 1e3]
                    for k, n, t0, t1, s, e in calls
                ]
                path = Path(out) / f"timeline-{os.getpid()}.json"
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"calls": rows, "reads": reads}))
                tmp.replace(path)

    Engine.run = run_and_dump


class _HostEvent:
    """cpu: a call is done when it returns, so the host's clock stamps it."""

    def record(self) -> None:
        self.t = time.monotonic()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _HostEvent) -> float:
        return (other.t - self.t) * 1e3


def load(folder: Path) -> dict[str, list[Any]]:
    """Every engine's calls and reads in ``folder`` (one file per engine process)."""
    calls: list[Any] = []
    reads: list[Any] = []
    for f in sorted(Path(folder).glob("timeline-*.json")):
        data = json.loads(f.read_text())
        calls += data["calls"]
        reads += data["reads"]
    calls.sort(key=lambda c: c[4])
    return {"calls": calls, "reads": reads}


def summarize(timeline: dict[str, list[Any]], start: float, end: float) -> dict[str, Any]:
    """The device inside [start, end] of the host's monotonic clock (one way's replay)."""
    calls = [c for c in timeline["calls"] if c[5] > start and c[4] < end]
    wall = end - start
    if not calls or wall <= 0:
        return {"calls": 0}
    busy: dict[str, float] = {}
    launch: dict[str, float] = {}
    count: dict[str, int] = {}
    gaps: list[float] = []
    gap_launching = 0.0  # of the gaps: the host inside the next call's launch
    last_end = max(start, calls[0][4])
    for kind, _rows, t0, t1, s, e in calls:
        s, e = max(s, start), min(e, end)
        busy[kind] = busy.get(kind, 0.0) + max(0.0, e - max(s, last_end))
        launch[kind] = launch.get(kind, 0.0) + (t1 - t0)
        count[kind] = count.get(kind, 0) + 1
        if s > last_end:
            gaps.append(s - last_end)
            gap_launching += max(0.0, min(s, t1) - max(last_end, t0))
        last_end = max(last_end, e)
    reads = sum(max(0.0, min(b, end) - max(a, start)) for a, b in timeline["reads"] if b > start)
    gaps.sort()
    total = sum(busy.values())
    return {
        "calls": len(calls),
        "wall_s": wall,
        "device_busy_s": total,
        "device_busy_fraction": total / wall,
        "busy_s_by_kind": busy,
        "calls_by_kind": count,
        "mean_ms_by_kind": {k: busy[k] / count[k] * 1e3 for k in busy},
        "host_launch_s_by_kind": launch,
        "host_in_reads_s": reads,
        "gaps": len(gaps),
        "gap_s": sum(gaps),
        "gap_p50_ms": gaps[len(gaps) // 2] * 1e3 if gaps else 0.0,
        "gap_p99_ms": gaps[int(len(gaps) * 0.99)] * 1e3 if gaps else 0.0,
        "gap_max_ms": gaps[-1] * 1e3 if gaps else 0.0,
        "gap_s_host_launching_next": gap_launching,
    }
