"""The server's state: the release, its tokenizer and the engine, made ready in a thread of
their own, which then stays the one thread that runs the model.

Phases: loading → warming up → ready (→ draining); or failed, with the error ``/ready`` shows.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.server.engine import Engine, EngineFailed
from pipeline.server.metrics import Metrics
from pipeline.server.tokenizer import load_tokenizer

log = logging.getLogger("inf2_pipeline.serve")


@dataclass
class ServeOptions:
    path: Path
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    max_prefills: int = 4  # prefills per iteration: each stalls the running rows
    spill: bool = True  # a request may take a free slot of a longer bucket rather than wait
    overflow: bool = False  # open a smaller idle bucket beside a full running one
    batching: str = "iteration"  # or "static": the batch-at-a-time baseline
    api_key: str | None = None  # required as `Authorization: Bearer` on /v1 when set
    # a chat answer's length when the request names none (None: what the largest bucket
    # holds after the prompt, as vLLM's default; a long reserve lands in the longest bucket)
    chat_max_tokens: int | None = None
    # a stream sends the tokens that piled up while the event loop was busy in one event
    # (less loop work per token under load; off: one event per token, always)
    coalesce: bool = False
    # launch each iteration's steps before reading the last one's tokens (cpu/cuda slots)
    overlap: bool = True
    # the keys whose signature the release must carry (pipeline.store.signing.Trust)
    trust: Any = None


class Service:
    def __init__(self, options: ServeOptions, loader: Callable[[Path], Any] | None = None):
        self.options = options
        self.loader = loader or functools.partial(_load_model, trust=options.trust)
        self.metrics = Metrics()
        self.phase = "loading"
        self.error: str | None = None
        self.failure: Exception | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.name = ""
        self.vocab = 0
        self.engine: Engine | None = None
        # what the resident buckets' samplers honour: a request's seed (False where an
        # export samples on the Neuron device), and the largest top_k (0: any)
        self.seeded = True
        self.max_topk = 0
        self.thread: threading.Thread | None = None
        self.on_failure: Callable[[], None] = lambda: None

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.thread = threading.Thread(
            target=self._main, args=(loop,), name="inf2-serve-model", daemon=True
        )
        self.thread.start()

    def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        o = self.options
        try:
            model = self.loader(o.path)
            self.tokenizer = load_tokenizer(model.dir)
            self.name = model.manifest.model
            self.vocab = model.vocab_size()
            self.phase = "warming up"
            model.warmup()
            # The buckets the runner keeps loaded (all of them on cpu/cuda; on neuron those
            # that fit the HBM budget, each export holding its own weights) are resident;
            # each runs once here, so one-time costs (allocation, lazy init) do not fall on
            # the first request.
            resident = model.warm_buckets()
            for bucket in resident:
                warm(model.slots(bucket))
            slots = [model.slots(b) for b in resident]
            self.seeded = all(getattr(s, "seeded", True) for s in slots)
            limits = [getattr(s, "max_topk", 0) for s in slots if getattr(s, "max_topk", 0)]
            self.max_topk = min(limits, default=0)
            self.model = model
            self.engine = Engine(
                model,
                resident,
                loop,
                max_queue=o.max_queue,
                max_prefills=o.max_prefills,
                spill=o.spill,
                overflow=o.overflow,
                batching=o.batching,
                overlap=o.overlap,
                hooks=self.metrics,
            )
        except Exception as e:
            self.failure = e
            self.error = (
                e.one_line() if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
            )
            self.phase = "failed"
            self.on_failure()
            return
        # What loading made (the tokenizer, the graphs, torch's modules) lives as long as the
        # server: out of the collector's view, so a full collection while serving walks only
        # what requests made (a pause of ~100 ms otherwise, in the middle of streams).
        gc.collect()
        gc.freeze()
        self.phase = "ready"
        self.metrics.ready.set(1)
        names = ", ".join(b.name for b in resident)
        log.info("ready: %s %s on %s (%s)", self.name, model.manifest.version, model.device, names)
        if o.trust is None:
            log.warning("not verifying the release's signature (no --trust)")
        try:
            self.engine.run()
        except EngineFailed as e:  # every request it held was failed; the server stops
            self.failure, self.error, self.phase = e, f"EngineFailed: {e}", "failed"
            self.metrics.ready.set(0)
            log.error("the engine stopped: %s", e)
            self.on_failure()

    def drain(self) -> None:
        """Shutting down: take no new requests; finish the queued and running ones."""
        self.metrics.ready.set(0)
        if self.engine is not None:
            self.phase = "draining"
            self.engine.close()

    async def stop(self) -> None:
        """Finish what is queued and running, then let the model thread end."""
        self.drain()
        if self.engine is not None and self.thread is not None:
            await asyncio.to_thread(self.thread.join)


def warm(slots: Any) -> None:
    """Run every graph the bucket has once, in slot 0 (then free it), so no first request
    pays a graph's first-call costs: a prompt at each prefill length (cpu/cuda; on neuron a
    two-token prompt, since one token takes the decode graph), a shared prefill call where
    the slots have one, and a step."""
    for n in getattr(slots, "prefill_lengths", None) or [min(2, slots.seq - 1)]:
        slots.prefill(0, [0] * n)
        slots.free(0)
    if slots.seq > 2:
        slots.prefill(0, [0, 0])
        slots.step([0])
        slots.free(0)
    if getattr(slots, "prefill_batch", 1) > 1:
        slots.prefill_many([0, 1], [[0, 0], [0, 0]])
        slots.free(0)
        slots.free(1)


def _load_model(path: Path, trust: Any = None) -> Any:
    from pipeline.runtime import BucketedModel

    return BucketedModel.load(path, trust=trust)
