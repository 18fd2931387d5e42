"""The release loaded and warmed, and an engine made over it: what ``serve`` does before it
answers, in whichever process runs the engine (its own, ``pipeline.server.engine_process``,
or the server's, ``pipeline.server.service``). ``ServeOptions`` are ``serve``'s flags."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contracts.bucket import Bucket
from pipeline.server.engine import Engine
from pipeline.server.jobs import Hooks
from pipeline.server.pacing import Pacer, call_costs
from pipeline.server.prefill_costs import measure_all, measure_step, mixed_prompts

log = logging.getLogger("inf2_pipeline.serve")


@dataclass
class ServeOptions:
    path: Path
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    max_prefills: int = 4  # prefills per iteration: each stalls the running rows
    # the prefill work an iteration may admit, by the start-up timings: "auto" (STALL_STEPS
    # of the slowest resident step), seconds, or "off" (max_prefills alone)
    prefill_stall: float | str = "off"
    # the order waiting requests are offered to placement: "fcfs", or "shortest" prompt
    # first (a request passed over once goes first from then on)
    admit_order: str = "fcfs"
    spill: bool = True  # a request may take a free slot of a longer bucket rather than wait
    overflow: bool = False  # open a smaller idle bucket beside a full running one
    widest_from_idle: bool = False  # several waiting, nothing running: open the widest
    # a prompt may share a prefill call at a longer length that pads it by at most this;
    # "auto": the calls that cost least by each bucket's prefill calls, timed at start-up
    prefill_merge: int | str = "auto"
    # a prompt admitted into a running bucket prefilled inside its step (a mixed call):
    # "auto" where the start-up timings say it costs less, "always", or "off"
    fold_prompts: str = "auto"
    batching: str = "iteration"  # or "static": the batch-at-a-time baseline
    api_key: str | None = None  # required as `Authorization: Bearer` on /v1 when set
    # a chat answer's length when the request names none (None: what the largest bucket
    # holds after the prompt, as vLLM's default; a long reserve lands in the longest bucket)
    chat_max_tokens: int | None = None
    # a stream sends the tokens that piled up while the event loop was busy in one event
    # (less loop work per token under load, as vLLM's streams do; off: one event per
    # token, always)
    coalesce: bool = True
    # launch each iteration's steps before reading the last one's tokens (cpu/cuda slots)
    overlap: bool = True
    # under overlap, launch an iteration this long before the device's queued work ends
    # (pipeline.server.pacing): "auto" adapts it from 0.5 ms, a float (s) holds it, "off"
    # launches as soon as the last tokens are read
    launch_lead: float | str = "auto"
    # the keys whose signature the release must carry (pipeline.store.signing.Trust)
    trust: Any = None
    # the engine in a process of its own: the HTTP side's Python never holds the GIL the
    # model thread needs between device calls (off: a thread of the server's process)
    engine_process: bool = True
    # HTTP processes in front of the one engine, sharing the listening socket
    # (pipeline.server.fronts): the SSE writes of many streams on more than one core
    http_workers: int = 1


@dataclass(frozen=True)
class Loaded:
    """What the HTTP side needs of the loaded release, in whichever process loaded it."""

    name: str
    version: str
    device: str
    dir: Path  # the release's files (its tokenizer)
    vocab: int
    buckets: tuple[Bucket, ...]  # the resident ones
    seeded: bool  # a request's seed is honoured (False where an export samples on Neuron)
    max_topk: int  # the largest top_k every resident sampler takes (0: any)
    need_extra: int  # tokens_needed(p, m) - p - m: the runner's rule, linear on every backend
    # seconds of each start-up phase so far, in order (metrics.STARTUP_PHASES): the ready line and
    # inf2_serve_startup_seconds, so a slow pod start says where its time went
    startup: dict[str, float] = field(default_factory=dict, compare=False)

    def tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens + self.need_extra

    @property
    def largest(self) -> Bucket:
        """The resident bucket with the longest sequence (then the largest batch)."""
        return max(self.buckets, key=lambda b: (b.seq, b.batch))


# What a server does before it answers, timed: the release opened (manifest and signature
# checked, the runtime imported), its resident buckets warmed (packages and weights onto the
# device, on neuron the exports; caches and CUDA graphs made; each graph run once: the cuda
# runner logs each bucket's parts), the engine made (its prefill calls and steps timed where a
# policy needs them), the tokenizer;
# "total" is from the server's state made (after the CLI's imports, ~0.5 s) to ready: the
# engine's process, and its wait for the fronts' tokenizers, included. The names:
# ``metrics.STARTUP_PHASES``.


def load_release(
    options: ServeOptions, loader: Callable[[Path], Any], phase: Callable[[str], None]
) -> tuple[Any, list[Bucket], Loaded]:
    """Load the release and warm its resident buckets: the model, those buckets, and what the
    HTTP side needs to know of them. ``phase`` hears "warming up"."""
    start = time.perf_counter()
    model = loader(options.path)
    loaded_at = time.perf_counter()
    phase("warming up")
    model.warmup()
    # The buckets the runner keeps loaded (all of them on cpu/cuda; on neuron those that fit
    # the HBM budget, each export holding its own weights) are resident; each runs once here,
    # so one-time costs (allocation, lazy init) do not fall on the first request.
    resident = model.warm_buckets()
    for bucket in resident:
        warm(model.slots(bucket))
    slots = [model.slots(b) for b in resident]
    limits = [getattr(s, "max_topk", 0) for s in slots if getattr(s, "max_topk", 0)]
    loaded = Loaded(
        name=model.manifest.model,
        version=model.manifest.version,
        device=str(model.device),
        dir=Path(model.dir),
        vocab=model.vocab_size(),
        buckets=tuple(sorted(resident)),
        seeded=all(getattr(s, "seeded", True) for s in slots),
        max_topk=min(limits, default=0),
        need_extra=model.tokens_needed(1, 1) - 2,
        startup={"load": loaded_at - start, "warm": time.perf_counter() - loaded_at},
    )
    return model, resident, loaded


def make_engine(
    model: Any,
    resident: Sequence[Bucket],
    options: ServeOptions,
    loop: asyncio.AbstractEventLoop | None,
    hooks: Hooks,
    startup: dict[str, float] | None = None,
    **more: Any,
) -> Engine:
    """The engine over ``resident``, its policies as ``options`` say; the seconds making it
    took (its calls timed) go in ``startup["engine"]``."""
    start = time.perf_counter()
    o = options
    auto = o.prefill_merge == "auto"
    # the largest call the engine makes: max_prefills prompts (static fills a whole bucket)
    most = None if o.batching == "static" else o.max_prefills
    paced = o.launch_lead != "off" and o.overlap and o.batching != "static"
    stall = o.prefill_stall != "off" and o.batching != "static"
    timed = auto or o.fold_prompts == "auto" or paced or stall
    costs = measure_all(model, list(resident), most) if timed else None
    # a fixed --prefill-stall needs no step; auto and the pacer are counted in steps
    stepped = paced or (stall and o.prefill_stall == "auto")
    steps = bucket_steps(model, resident, costs or {}) if stepped else {}
    engine = Engine(
        model,
        resident,
        loop,
        max_queue=more.pop("max_queue", o.max_queue),
        max_prefills=o.max_prefills,
        spill=o.spill,
        overflow=o.overflow,
        widest_from_idle=o.widest_from_idle,
        prefill_merge=0 if auto else int(o.prefill_merge),
        prefill_costs=costs if auto else None,
        fold=o.fold_prompts,
        call_costs=costs,
        prefill_stall=stall_budget(o.prefill_stall, steps, costs) if stall else None,
        admit_order=o.admit_order,
        batching=o.batching,
        overlap=o.overlap,
        hooks=hooks,
        pacer=make_pacer(steps, o.launch_lead, costs or {}) if paced else None,
        **more,
    )
    if startup is not None:
        startup["engine"] = time.perf_counter() - start
    return engine


def bucket_steps(
    model: Any, resident: Sequence[Bucket], costs: dict[Bucket, Any]
) -> dict[Bucket, float]:
    """Each resident bucket's step, timed at start-up (``costs``' where it timed one), for
    the buckets whose slots launch (cpu/cuda; neuron's calls are not queued ahead)."""
    steps: dict[Bucket, float] = {}
    for bucket in resident:
        slots = model.slots(bucket)
        if not hasattr(slots, "launch"):
            continue
        table = costs.get(bucket)
        step = table.step if table is not None and table.step else measure_step(slots)
        if step:
            steps[bucket] = step
    return steps


# ``--prefill-stall auto``: an iteration's prefills may take this many of the slowest
# resident step. On the H200 a b32 step is ~1.2 ms and the current replay's opening burst of
# 32 short prompts costs 11.5-12 ms in its cheapest calls (bench/RESULTS.md, seventeenth
# round): such a burst goes in at once, while prompts of a thousand tokens go a few at a
# time.
STALL_STEPS = 10


def stall_budget(
    value: float | str, steps: dict[Bucket, float], costs: dict[Bucket, Any] | None
) -> float | None:
    """``--prefill-stall`` in seconds: "auto" is ``STALL_STEPS`` of the slowest timed step;
    None (the count alone) where no bucket's prefill calls or steps were timed (neuron: its
    context encoding takes one prompt a call), with a line saying so."""
    if not costs:
        log.info("--prefill-stall: no prefill calls timed here; --max-prefills alone")
        return None
    if value != "auto":
        return float(value)
    if not steps:
        log.info("--prefill-stall auto: no step timed here; --max-prefills alone")
        return None
    budget = STALL_STEPS * max(steps.values())
    log.info("an iteration's prefills stall at most %.2fms (--prefill-stall auto)", budget * 1e3)
    return budget


def make_pacer(
    steps: dict[Bucket, float], lead: float | str, costs: dict[Bucket, Any]
) -> Pacer | None:
    """The engine's launch clock (``pacing``), from each bucket's step timed at start-up
    (``bucket_steps``) and its mixed calls; None where no bucket's slots launch (neuron:
    nothing is queued ahead to hold)."""
    if not steps:
        return None
    log.info(
        "launches held until the device's work is about to end (lead %s); steps: %s",
        lead if lead == "auto" else f"{float(lead) * 1e3:.2f}ms",
        ", ".join(f"{b.name} {s * 1e3:.2f}ms" for b, s in sorted(steps.items())),
    )
    if lead == "auto":
        return Pacer(call_costs(steps, costs))
    return Pacer(call_costs(steps, costs), lead_s=float(lead), adapt=False)


def warm(slots: Any) -> None:
    """Run every graph the bucket has once, in slot 0 (then free it), so no first request
    pays a graph's first-call costs: a prompt at each prefill length (cpu/cuda; on neuron a
    two-token prompt, since one token takes the decode graph), a shared prefill call where
    the slots have one, a step, and a mixed call at each mixed length."""
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
    if hasattr(slots, "launch_mixed") and slots.seq > 2:  # a step with prompts in it
        for n in getattr(slots, "mixed_lengths", ()):
            sizes = mixed_prompts(n, slots.seq, int(getattr(slots, "mixed_batch", 1)))
            if sizes is None:
                continue
            rows = list(range(1, len(sizes) + 1))
            slots.prefill(0, [0, 0])
            slots.launch_mixed([0], rows, [[0] * k for k in sizes]).tokens()
            for r in (0, *rows):
                slots.free(r)
