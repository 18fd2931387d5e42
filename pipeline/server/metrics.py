"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own; the engine's
``Hooks`` (``pipeline.server.engine``) are its methods.

Padding efficiency of live traffic, per bucket and phase, from
``inf2_serve_positions_total{bucket, phase, kind}``:
    real / (real + padding)
- ``phase="prefill"``: a prompt of n tokens is real n of the prefill graph's length (cpu/cuda:
  the shortest prefill length that holds it; neuron: the export's sequence length);
- ``phase="decode"``: a step of a bucket of batch B computes B rows, of which those in use
  are real: the slots' occupancy while it steps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pipeline.contracts.bucket import Bucket

# inf2_serve_startup_seconds' phases, in order (``loading`` times the first three, the front
# the tokenizer), and the ready line's
STARTUP_PHASES = ("load", "warm", "engine", "tokenizer")

# Seconds: tiny cpu models answer in milliseconds, big ones on a slow device in minutes.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
# Queue time and TTFT: a GPU's first tokens take milliseconds, and an SLO of "p99 under
# 3x a lone request's" needs their spread resolved there (vLLM's TTFT buckets start at 1 ms
# too); long prefills on a slow device still land below the largest.
_FIRST_TOKEN = (
    *(0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03),
    *(0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
# Admission (body read, checked, tokenized): a hundred microseconds for token ids, more for
# a long text prompt, and as long as the event loop makes a new request wait when it is busy.
_ADMISSION = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
# The event loop's lag: ~0.2 ms idle (the sleep's own overshoot), milliseconds behind 32
# streams' events, tens when a small host's front is saturated.
_LOOP_LAG = (
    *(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015),
    *(0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 1),
)
LOOP_PROBE_EVERY = 0.01  # 100 probes a second: ~0.1 % of a core


class Metrics:
    def __init__(self, shared: bool = False) -> None:
        # several HTTP processes (serve --http-workers): each writes its own files, and
        # /metrics sums them (pipeline.server.fronts.shared_metrics); only then, not
        # whenever the environment names a folder (an image made for gunicorn may)
        self.shared = shared
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "inf2_serve_requests",
            "Completion requests by outcome (ok, invalid, too_long, queue_full, not_ready, "
            "disconnected, error)",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "inf2_serve_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.completion_tokens = Counter(
            "inf2_serve_completion_tokens", "Tokens sent back to clients", registry=r
        )
        self.prefills = Counter(
            "inf2_serve_prefills",
            "Prefills run (one request each), by bucket",
            ["bucket"],
            registry=r,
        )
        self.folded = Counter(
            "inf2_serve_prefills_folded",
            "Prefills run inside a decode step (a mixed call: serve --fold-prompts), by "
            "bucket; counted in inf2_serve_prefills too",
            ["bucket"],
            registry=r,
        )
        self.steps = Counter(
            "inf2_serve_steps", "Decode steps run, by bucket", ["bucket"], registry=r
        )
        self.positions = Counter(
            "inf2_serve_positions",
            "Token positions computed, by bucket and phase (prefill, decode): kind=real (a "
            "request's) or padding",
            ["bucket", "phase", "kind"],
            registry=r,
        )
        self.slots_gauge = Gauge(
            "inf2_serve_slots",
            "KV-cache slots of each resident bucket, by state (busy, free)",
            ["bucket", "state"],
            registry=r,
            multiprocess_mode="livesum",  # front 0 alone sets it, from the engine's records
        )
        self.queue_depth_gauge = Gauge(
            "inf2_serve_queue_depth",
            "Requests waiting for a slot",
            registry=r,
            multiprocess_mode="livesum",  # front 0 alone sets it
        )
        self.in_flight = Gauge(
            "inf2_serve_in_flight",
            "Requests admitted and not yet answered",
            registry=r,
            multiprocess_mode="livesum",  # each front's own
        )
        self.ready = Gauge(
            "inf2_serve_ready",
            "1 once the release is loaded and warm",
            registry=r,
            multiprocess_mode="livemin",  # ready when every front is
        )
        self.startup = Gauge(
            "inf2_serve_startup_seconds",
            f"Seconds of each start-up phase ({', '.join(STARTUP_PHASES)}) and in all "
            "(total: from serve's start, after its imports, to ready)",
            ["phase"],
            registry=r,
            multiprocess_mode="max",  # front 0 alone sets it (the others are quiet)
        )
        self.queue_time = Histogram(
            "inf2_serve_queue_time_seconds",
            "Arrival to the prefill that takes a slot",
            buckets=_FIRST_TOKEN,
            registry=r,
        )
        self.ttft = Histogram(
            "inf2_serve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_FIRST_TOKEN,
            registry=r,
        )
        # the two ends of a first token outside the engine: before arrival, and after its
        # token, until the front has written it (the client's TTFT minus these and the
        # engine's is the network and the client)
        self.admission = Histogram(
            "inf2_serve_admission_seconds",
            "The route's start to the request's arrival in the engine's queue (body read, "
            "checked, tokenized)",
            buckets=_ADMISSION,
            registry=r,
        )
        self.ttft_written = Histogram(
            "inf2_serve_time_to_first_token_written_seconds",
            "Arrival to the first token's event written to the client's connection (streamed "
            "answers)",
            buckets=_FIRST_TOKEN,
            registry=r,
        )
        # what a request's bytes or a stream's token wait for this process's event loop: the
        # part of the client's TTFT that neither the engine's nor the write's figures show
        self.loop_lag = Histogram(
            "inf2_serve_event_loop_lag_seconds",
            "How late the HTTP process's event loop wakes a task whose timer is due (sampled "
            f"every {LOOP_PROBE_EVERY * 1000:g} ms; each front its own): about what anything "
            "that becomes ready waits on a busy loop",
            buckets=_LOOP_LAG,
            registry=r,
        )
        self.itl = Histogram(
            "inf2_serve_inter_token_latency_seconds",
            "Between two tokens of one request",
            buckets=_PER_TOKEN,
            registry=r,
        )
        self.engine_seconds = Counter(
            "inf2_serve_engine_seconds",
            "The model thread's time, by part: wait (no work), prefill and step (inside the "
            "runner's calls, host sync included), other (the engine's own work around them)",
            ["part"],
            registry=r,
        )
        self._engine_parts = {
            p: self.engine_seconds.labels(p) for p in ("wait", "prefill", "step", "other")
        }
        self.launches = Counter(
            "inf2_serve_held_launches",
            "Iterations whose launch was held until the device's queued work was about to end "
            "(serve --launch-lead), by the device then: busy (in time) or idle (late: it ran "
            "dry)",
            ["device"],
            registry=r,
        )
        self.lead = Gauge(
            "inf2_serve_launch_lead_seconds",
            "How long before the device's queued work ends the engine launches the next "
            "iteration (adapts under --launch-lead auto)",
            registry=r,
            multiprocess_mode="livesum",  # front 0 alone sets it, from the engine's records
        )
        self.latency = Histogram(
            "inf2_serve_request_duration_seconds",
            "Arrival to the last token",
            buckets=_LATENCY,
            registry=r,
        )

    def exposition(self) -> tuple[bytes, str]:
        """``/metrics``' body and content type: this registry, or every front's files."""
        if not self.shared:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client import multiprocess

        summed = CollectorRegistry()
        multiprocess.MultiProcessCollector(summed)
        return generate_latest(summed), CONTENT_TYPE_LATEST

    # --- the engine's hooks (called on the model thread) ---------------------------------

    def queue_depth(self, n: int) -> None:
        self.queue_depth_gauge.set(n)

    def admitted(self, req: Any, now: float) -> None:
        self.queue_time.observe(now - req.arrival)

    def token(self, req: Any, now: float) -> None:
        if req.produced == 1:
            self.ttft.observe(now - req.arrival)
        else:
            self.itl.observe(now - req.last_token)

    def prefill(self, bucket: Bucket, real: int, computed: int, folded: bool = False) -> None:
        self.prefills.labels(bucket.name).inc()
        if folded:
            self.folded.labels(bucket.name).inc()
        self.positions.labels(bucket.name, "prefill", "real").inc(real)
        self.positions.labels(bucket.name, "prefill", "padding").inc(max(computed - real, 0))

    def step(self, bucket: Bucket, rows: int) -> None:
        self.steps.labels(bucket.name).inc()
        self.positions.labels(bucket.name, "decode", "real").inc(rows)
        self.positions.labels(bucket.name, "decode", "padding").inc(bucket.batch - rows)

    def slots(self, bucket: Bucket, busy: int) -> None:
        self.slots_gauge.labels(bucket.name, "busy").set(busy)
        self.slots_gauge.labels(bucket.name, "free").set(bucket.batch - busy)

    def engine_time(self, wait: float, prefill: float, step: float, other: float) -> None:
        parts = self._engine_parts
        parts["wait"].inc(wait)
        parts["prefill"].inc(prefill)
        parts["step"].inc(step)
        parts["other"].inc(max(other, 0.0))

    def launch(self, late: bool, lead: float) -> None:
        self.launches.labels("idle" if late else "busy").inc()
        self.lead.set(lead)

    def idle(self) -> None:
        pass

    # --- the HTTP side ---------------------------------------------------------------------

    async def probe_loop(self, every: float = LOOP_PROBE_EVERY) -> None:
        """Until cancelled: every ``every`` seconds, how late this task wakes from a sleep
        that ends then. The wake-up is a pass through the loop's ready queue, so the lag is a
        loop blocked past the timer plus the ready work queued ahead (32 streams' events of
        one step): what a request's bytes or a stream's token wait for. ``perf_counter``, as
        uvloop's own clock is in milliseconds."""
        clock, observe = time.perf_counter, self.loop_lag.observe
        while True:
            due = clock() + every
            await asyncio.sleep(every)
            observe(max(clock() - due, 0.0))

    def finished(self, arrival: float, end: float) -> None:
        self.latency.observe(end - arrival)
