"""``inf2-pipeline serve`` under a replay of real request lengths, streamed, beside what the
release could do at best, all in one run per release:

* serve: the default server (iteration-level batching) at each ``--concurrency``: that many
  client threads in a closed loop, each streaming (``"stream": true``, server-sent events)
  over its own keep-alive connection, so that each request's time to first token (TTFT) and
  inter-token latencies (ITL) are measured at the client;
* static: ``serve --batching static`` (a bucket admits only when all its rows are done: the
  batch-at-a-time server of before) on the same requests, at each concurrency;
* lone: the default server with one client, one request at a time; its TTFT p50 is the lone
  request's TTFT that every way's p99 TTFT is divided by;
* steady decode: ``Slots.step`` over every slot of each bucket (short prompts), in this
  process while no server runs: the release's decode rate at each bucket batch;
* ceiling: every request's prefill alone (its prompt in the bucket of the largest batch whose
  length holds prompt + answer) plus its other tokens at the largest batch's step time per
  row, that step timed with every slot held by the replay's own requests (``replay_decode``:
  rows at the replay's positions, as a step of a full engine would be); ``× ceiling`` is a
  way's throughput ÷ the ceiling's. The ceiling at the steady decode's short-fill step is
  printed beside it (the figure of rounds before the fifteenth);
* peer (``--peer PATH/peer_serve.py``, a copy of ../shared/peers/hf-continuous-batching):
  transformers' continuous batching on the same request lengths, run after the servers stop.

Request lengths come from the Azure conversation trace (ContextTokens, GeneratedTokens),
sampled with a fixed seed and scaled so that the trace's p95 request (prompt + generated)
fills ``--scale-to`` positions (default: the release's largest bucket); longer ones are
clipped to fit, prompt first. Prompts are random token ids (seeded). peer_serve.py draws the
same requests from the same arguments. Every answer of every way is compared with the
model's output for that prompt alone (generated here, one prompt at a time, before the
servers start); any difference fails the run unless ``--tolerate-mismatch``, and
``--skip-alone`` leaves the comparison out (a device call short of time: the s256 replay's
4,000 answers alone are ~53,000 steps at batch 1). Slot occupancy
(decode rows in use ÷ rows stepped), prefill padding efficiency and steps come from the
server's /metrics, scraped before and after each way. With ``--interleave-servers`` every
server starts first and their rounds run in turn (round 1 of each, then round 2 of each), so
that a host whose speed drifts within the run weighs on every server alike; each round's
``started_s`` says when it ran. Loopback only; stops by itself.

    python bench/bench_serve.py pulled/tiny-llama [--requests 300] [--concurrency 32,64] \\
        [--scale-to SEQ] [--json FILE] [--peer peers/hf-continuous-batching/peer_serve.py]
"""

from __future__ import annotations

import argparse
import functools
import gc
import http.client
import itertools
import json
import multiprocessing
import os
import platform
import queue
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
BENCH_START = time.monotonic()  # rounds say when they started (``started_s``)
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(HERE))  # device_timeline

import host_probe  # noqa: E402

from pipeline._files import atomic_write_text  # noqa: E402
from pipeline.errors import InputError  # noqa: E402
from pipeline.install.installed import find_release  # noqa: E402
from pipeline.plan.traces import read_lengths  # noqa: E402
from tests.serve_helpers import ServerProcess, get, metric  # noqa: E402

TRACE_NAME = "AzureLLMInferenceTrace_conv.csv"
# Beside the checkout (a developer's machine), in it (a device machine's copy carries
# shared/ or peers/, see bench/prepare_device_bench.sh).
TRACES = (
    REPO.parent / "shared" / "traces" / TRACE_NAME,
    REPO / "shared" / "traces" / TRACE_NAME,
    REPO / "peers" / TRACE_NAME,
)
WAYS = ("lone", "serve", "thread", "serial", "sampled", "static")
# Each server the ways run on, and its flags: thread is the engine on a thread of the server's
# process (``serve --no-engine-process``), serial the engine reading each step's tokens before
# it launches the next (``serve --no-overlap``): the default's baselines.
SERVERS = {
    "iteration": ["--batching", "iteration"],
    "thread": ["--batching", "iteration", "--no-engine-process"],
    "serial": ["--batching", "iteration", "--no-overlap"],
    "static": ["--batching", "static"],
}
# The sampled way's requests (the figure: beside greedy on the same replay); each
# request's seed is its index, so a rerun draws the same tokens.
SAMPLED = {"temperature": 0.7, "top_p": 0.9}

Work = list[tuple[list[int], int]]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the requests ------------------------------------------------------------------------------


def workload(trace: Path, model: Any, n: int, seed: int, scale_to: int | None = None) -> Work:
    """``n`` (prompt ids, max_tokens) from the trace, scaled so that its p95 request fills
    ``scale_to`` positions (default: the model's largest bucket) and clipped to fit them.
    peers/hf-continuous-batching/peer_serve.py keeps the same rule (same seed, same draws)."""
    seq = scale_to or model.max_seq
    ctx = read_lengths(trace, "ContextTokens")
    gen = read_lengths(trace, "GeneratedTokens")
    totals = sorted(c + g for c, g in zip(ctx, gen, strict=True))
    scale = seq / totals[int(0.95 * (len(totals) - 1))]
    rng = random.Random(seed)
    vocab = model.vocab_size()
    out = []
    for i in rng.sample(range(len(ctx)), n):
        p = max(1, round(ctx[i] * scale))
        g = max(1, round(gen[i] * scale))
        while model.tokens_needed(p, g) > seq:  # clip the longest: prompt first
            if p > 1:
                p -= 1
            else:
                g -= 1
        out.append(([rng.randrange(3, vocab) for _ in range(p)], g))
    return out


def quantile(xs: list[float], q: float) -> float | None:
    """The same rank as peer_serve.py's p99 (and the bench's before): sorted[int(q·(n−1))]."""
    if not xs:
        return None
    s = sorted(xs)
    return statistics.median(s) if q == 0.5 else s[int(q * (len(s) - 1))]


# --- the clients -------------------------------------------------------------------------------


@dataclass
class Answer:
    ids: list[int]
    ttft: float | None  # s from sending the request to the first token's event
    gaps: list[float] = field(default_factory=list)  # s between tokens (0: in the same event)
    latency: float = 0.0  # s from sending to the last event


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """When each of ``n`` requests is due, in seconds from the start: a Poisson process of
    ``rate`` requests a second (exponential gaps), the first at 0."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


Raw = tuple[float, list[tuple[float, bytes]], float]  # sent, (arrival, data line)s, ended


def replay(
    url: str,
    name: str,
    work: Work,
    concurrency: int,
    timeout: float,
    sampling: dict[str, float] | None = None,
    arrivals: list[float] | None = None,
    procs: int = 1,
    cpus: set[int] | None = None,
    usage: dict[str, float] | None = None,
) -> tuple[float, list[Answer | None], list[str]]:
    """Send every request from ``concurrency`` client threads, each on its own keep-alive
    connection, streaming; returns (seconds, answers in request order, errors).
    ``sampling``: sampling fields for every request (with ``seed``: its index).
    ``arrivals``: open loop, request i is due that many seconds after the start (a thread
    free by then sends it then, else as soon as one frees), and its TTFT and latency count
    from when it was due, so a pool too small to keep up shows as waiting, not as speed.
    Without: closed loop, each thread sends its next request when its last one ends.
    ``procs``: the threads spread over that many forked processes, so the clients' own
    turns for one GIL do not add to the times they stamp (perf_counter is the system's
    monotonic clock, the same in every process). ``cpus``: the client processes run on
    these CPUs only (``--client-cpus``). ``usage``: filled with the clients' CPU seconds and
    involuntary switches (bench/host_probe.py).

    While streaming, a thread only stamps each ``data:`` line with its arrival time; the
    JSON is parsed after the clock stops, so parsing does not delay the other threads."""
    procs = max(1, min(procs, concurrency))
    send = functools.partial(_clients, url, name, work, timeout, sampling, arrivals)
    if procs == 1:
        u0 = host_probe.own_usage()
        start = time.perf_counter()
        raw, errors = send(concurrency, start)
        wall = time.perf_counter() - start
        spent = {k: v - u0[k] for k, v in host_probe.own_usage().items()}
    else:
        wall, raw, errors, spent = _client_procs(send, len(work), concurrency, procs, timeout, cpus)
    if usage is not None:
        usage.update(spent)
    answers: list[Answer | None] = []
    for i in range(len(work)):
        item = raw.get(i)
        if item is None:
            answers.append(None)
            continue
        sent, events, end = item
        ans = Answer([], None, latency=end - sent)
        prev = None
        for t, payload in events:
            try:
                data = json.loads(payload)
            except json.JSONDecodeError:
                errors.append(f"request {i}: an event that is not JSON: {payload[:200]!r}")
                break
            if "error" in data:
                errors.append(f"request {i}: {data['error']}")
                break
            choices = data.get("choices") or []
            ids = list(choices[0].get("token_ids") or []) if choices else []
            if not ids:
                continue  # the finish chunk, or text held back
            if prev is None:
                ans.ttft = t - sent
            else:
                ans.gaps.append(t - prev)
            ans.gaps += [0.0] * (len(ids) - 1)  # tokens that came in the same event
            prev = t
            ans.ids += ids
        answers.append(ans)
    return wall, answers, errors


def _clients(
    url: str,
    name: str,
    work: Work,
    timeout: float,
    sampling: dict[str, float] | None,
    arrivals: list[float] | None,
    threads_n: int,
    start: float,
    take: Any = None,
) -> tuple[dict[int, Raw], list[str]]:
    """``threads_n`` client threads sending the requests ``take()`` hands out (default: each
    in turn) until it gives None; their raw streams by request index, and errors."""
    host = urlparse(url)
    raw: dict[int, Raw] = {}
    errors: list[str] = []
    headers = {"Content-Type": "application/json"}
    if take is None:
        todo, lock = iter(range(len(work))), threading.Lock()

        def take() -> int | None:
            with lock:
                return next(todo, None)

    def one(conn: http.client.HTTPConnection, i: int, body: bytes) -> None:
        t0 = time.perf_counter()
        if arrivals is not None:
            due = start + arrivals[i]
            if due > t0:
                time.sleep(due - t0)
            t0 = due
        conn.request("POST", "/v1/completions", body, headers)
        r = conn.getresponse()
        if r.status != 200:
            errors.append(f"request {i}: HTTP {r.status}: {r.read()[:300]!r}")
            return
        events: list[tuple[float, bytes]] = []
        done = False
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                t = time.perf_counter()
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                events.append((t, payload))
        end = time.perf_counter()
        r.read()  # the end of the chunked body, so that the connection can be reused
        if not done:
            errors.append(f"request {i}: the stream ended before [DONE]")
            return
        raw[i] = (t0, events, end)

    def client() -> None:
        conn: http.client.HTTPConnection | None = None
        while True:
            i = take()
            if i is None:
                break
            prompt, n = work[i]
            fields = {"model": name, "prompt": prompt, "max_tokens": n, "stream": True}
            if sampling:
                fields.update(sampling, seed=i)
            body = json.dumps(fields).encode()
            for attempt in (1, 2):  # once more on a fresh connection if the idle one was shut
                if conn is None:
                    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=timeout)
                try:
                    one(conn, i, body)
                    break
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    conn.close()
                    conn = None
                    if attempt == 2:
                        errors.append(f"request {i}: the connection was closed twice")
                except Exception as e:  # a timeout, a broken response: this request fails
                    conn.close()
                    conn = None
                    errors.append(f"request {i}: {type(e).__name__}: {e}")
                    break
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return raw, errors


def _client_procs(
    send: Callable[..., tuple[dict[int, Raw], list[str]]],
    requests: int,
    concurrency: int,
    procs: int,
    timeout: float,
    cpus: set[int] | None = None,
) -> tuple[float, dict[int, Raw], list[str], dict[str, float]]:
    """``send`` (``_clients`` bound to the replay) in ``procs`` forked processes sharing one
    counter of the ``requests`` handed out (so each sends the next when one of its threads
    frees, as in one process). They are forked first and started together, so the clock
    does not count the forks. Also returns their CPU seconds and involuntary switches."""
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("i", 0)
    start = ctx.Value("d", 0.0)
    go = ctx.Event()
    results = ctx.Queue()

    def take() -> int | None:
        with counter.get_lock():
            i = counter.value
            counter.value += 1
        return i if i < requests else None

    def child(threads_n: int) -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        go.wait()
        u0 = host_probe.own_usage()
        got = send(threads_n, start.value, take)
        spent = {k: v - u0[k] for k, v in host_probe.own_usage().items()}
        results.put((time.perf_counter(), got, spent))  # when its last thread ended

    shares = [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
    kids = [ctx.Process(target=child, args=(n,), daemon=True) for n in shares]
    for k in kids:
        k.start()
    raw: dict[int, Raw] = {}
    errors: list[str] = []
    end = 0.0
    usage = {"cpu_s": 0.0, "involuntary": 0.0}
    try:
        start.value = time.perf_counter()
        go.set()
        # Read before join: a child blocks on a full queue until read. Waited for in short
        # polls: one wait of timeout × requests overflows poll(2)'s milliseconds past ~3,580
        # requests at the default 600 s (OverflowError at 4,000 on a device, 2026-12-07),
        # and a child that died without a report must not be waited for that long either.
        deadline = time.monotonic() + timeout * requests + 60
        for _ in kids:
            t, (got, errs), spent = _next_report(results, kids, deadline)
            end = max(end, t)
            raw.update(got)
            errors += errs
            for k, v in spent.items():
                usage[k] += v
    finally:
        for k in kids:
            k.join(5)
            if k.is_alive():
                k.kill()
    return end - start.value, raw, errors, usage


def _next_report(results: Any, kids: list, deadline: float) -> Any:
    """The next client process's report from ``results`` (a multiprocessing queue), polled
    a second at a time until ``deadline``; RuntimeError if every process ended without one
    left to read, or the deadline passed."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise RuntimeError("the client processes did not finish in time") from None
            if not any(k.is_alive() for k in kids):
                try:  # the last report may still be in the pipe
                    return results.get(timeout=1.0)
                except queue.Empty:
                    raise RuntimeError("a client process ended without its answers") from None


# --- the server's own counts -------------------------------------------------------------------


def scrape(url: str) -> str:
    status, text = get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"GET /metrics: HTTP {status}")
    return text


# what the JSON keeps of every round of a way (its headline is the fastest round's)
ROUND_FIGURES = (
    "seconds",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_p99_after_burst_s",
    "itl_p99_s",
    "server_ttft_p99_s",
    "server_queue_p99_s",
    "server_loop_lag_p99_s",
    "server_written_p99_s",
    "answers_differing_from_alone",
    "started_s",
    "host",
)


def startup_seconds(text: str) -> dict[str, float]:
    """The server's start-up by phase (``inf2_serve_startup_seconds``): load, warm, engine,
    tokenizer, total."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["phase"]: round(s.value, 3)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "inf2_serve_startup_seconds"
    }


def histogram_quantile(before: str, after: str, name: str, q: float) -> float | None:
    """The ``q`` quantile of what histogram ``name`` observed between two scrapes,
    interpolated linearly inside its bucket as Prometheus' ``histogram_quantile`` does
    (the largest finite bound where it falls in the last); None where it observed nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts(text: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name + "_bucket":
                    le = float(s.labels["le"])
                    out[le] = out.get(le, 0.0) + s.value  # summed over fronts' labels
        return out

    old, new = counts(before), counts(after)
    cum = sorted((le, n - old.get(le, 0.0)) for le, n in new.items())
    if not cum or cum[-1][1] <= 0:
        return None
    rank = q * cum[-1][1]
    lower, below = 0.0, 0.0
    for le, n in cum:
        if n >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
        lower, below = le, n
    return lower


def server_figures(before: str, after: str, buckets: list[str]) -> dict[str, Any]:
    """What /metrics counted between two scrapes."""

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    pos = "inf2_serve_positions_total"
    dec_real, dec_pad = (
        delta(pos, phase="decode", kind="real"),
        delta(pos, phase="decode", kind="padding"),
    )
    pre_real = delta(pos, phase="prefill", kind="real")
    pre_pad = delta(pos, phase="prefill", kind="padding")

    def mean(hist: str) -> float | None:
        n = delta(hist + "_count")
        return delta(hist + "_sum") / n if n else None

    return {
        "slot_occupancy": dec_real / (dec_real + dec_pad) if dec_real + dec_pad else None,
        "prefill_padding_efficiency": pre_real / (pre_real + pre_pad)
        if pre_real + pre_pad
        else None,
        "decode_positions": {"real": int(dec_real), "padding": int(dec_pad)},
        "prefill_positions": {"real": int(pre_real), "padding": int(pre_pad)},
        "steps": int(delta("inf2_serve_steps_total")),
        "prefills": int(delta("inf2_serve_prefills_total")),
        # of those, prefilled inside a step (a mixed call: serve --fold-prompts)
        "prefills_folded": int(delta("inf2_serve_prefills_folded_total")),
        "steps_by_bucket": {b: int(delta("inf2_serve_steps_total", bucket=b)) for b in buckets},
        "prefills_by_bucket": {
            b: int(delta("inf2_serve_prefills_total", bucket=b)) for b in buckets
        },
        # the model thread's seconds: waiting, in prefill calls, in step calls, around them
        "engine_seconds": {
            part: delta("inf2_serve_engine_seconds_total", part=part)
            for part in ("wait", "prefill", "step", "other")
        },
        # launches held for the device (serve --launch-lead): in time, and late (it idled)
        "held_launches": {
            when: int(delta("inf2_serve_held_launches_total", device=state))
            for when, state in (("in_time", "busy"), ("late", "idle"))
        },
        "server_mean_queue_time_s": mean("inf2_serve_queue_time_seconds"),
        "server_mean_ttft_s": mean("inf2_serve_time_to_first_token_seconds"),
        "server_mean_itl_s": mean("inf2_serve_inter_token_latency_seconds"),
        # arrival at the front to the engine's first token, from the histogram's buckets:
        # beside the client's TTFT, what is spent delivering it (engine -> front -> client)
        # and of that, waiting to be admitted (arrival at the front to the engine placing it);
        # the front's own ends: the route's start to arrival (admission), and arrival to the
        # first token's event written to the socket (written - ttft: the front's delivery)
        **{
            f"server_{key}_p{round(q * 100)}_s": histogram_quantile(before, after, hist, q)
            for key, hist in (
                ("ttft", "inf2_serve_time_to_first_token_seconds"),
                ("queue", "inf2_serve_queue_time_seconds"),
                ("admission", "inf2_serve_admission_seconds"),
                ("written", "inf2_serve_time_to_first_token_written_seconds"),
                # how late the front's event loop woke a task due (sampled): its backlog
                ("loop_lag", "inf2_serve_event_loop_lag_seconds"),
            )
            for q in (0.5, 0.99)
        },
    }


def way_figures(
    work: Work,
    alone: list[list[int]] | None,
    wall: float,
    answers: list[Answer | None],
    errors: list[str],
    server: dict[str, Any],
    concurrency: int = 1,
) -> dict[str, Any]:
    got = [a for a in answers if a is not None]
    ttft = [a.ttft for a in got if a.ttft is not None]
    # the opening burst (every client's first request arrives at once) apart: its first
    # tokens wait for each other's prefills, which no steady state does
    steady = [a.ttft for a in answers[concurrency:] if a is not None and a.ttft is not None]
    gaps = [g for a in got for g in a.gaps]
    lat = [a.latency for a in got]
    wrong = [i for i, a in enumerate(answers) if a is not None and alone and a.ids != alone[i]]
    out_tokens = sum(len(a.ids) for a in got)
    return {
        "seconds": wall,
        "requests": len(got),
        "output_tokens": out_tokens,
        "requests_per_s": len(got) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "ttft_p99_after_burst_s": quantile(steady, 0.99),
        "itl_p50_s": quantile(gaps, 0.5),
        "itl_p99_s": quantile(gaps, 0.99),
        "latency_p50_s": quantile(lat, 0.5),
        "latency_p99_s": quantile(lat, 0.99),
        **server,
        "answers_differing_from_alone": len(wrong),
        "first_differing": wrong[:5],
        "failed_requests": len(work) - len(got),
        "errors": errors[:5],
    }


# --- in this process, before any server: the truth, the decode rate, the prefills -------------


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def steady_decode(
    model: Any, bucket: Any, steps: int, prompt: int = 8, seed: int = 1
) -> dict[str, Any]:
    """Tokens/s of ``slots.step(every slot)``: every slot prefilled with a ``prompt``-token
    prompt (at most a quarter of the bucket), a few steps of warm-up, then ``steps`` timed
    steps (refilled when the bucket's length runs out; refills are not timed)."""
    slots = model.slots(bucket)
    b, s = slots.batch, slots.seq
    n = max(1, min(prompt, s // 4))
    warm = 3
    per_fill = s - n - warm  # the steps one fill allows after its warm-up
    if per_fill < 1:
        return {"batch": b, "seq": s, "error": f"s{s} leaves no steps after a {n}-token prompt"}
    rng = random.Random(seed)
    vocab = model.vocab_size()
    rows = list(range(b))
    timed, secs = 0, 0.0
    try:
        while timed < steps:
            for r in rows:
                slots.prefill(r, [rng.randrange(3, vocab) for _ in range(n)])
            for _ in range(warm):
                slots.step(rows)
            k = min(per_fill, steps - timed)
            _sync(model.device)
            t0 = time.perf_counter()
            for _ in range(k):
                slots.step(rows)  # reads the tokens back: a host sync per step
            _sync(model.device)
            secs += time.perf_counter() - t0
            timed += k
    finally:
        for r in rows:
            slots.free(r)
    return {
        "batch": b,
        "seq": s,
        "prompt": n,
        "steps": timed,
        "step_ms": secs / timed * 1e3,
        "tokens_per_s": b * timed / secs,
    }


def replay_decode(
    model: Any, bucket: Any, work: Work, answers: list[int] | None = None
) -> dict[str, Any]:
    """The decode step of ``bucket`` with every slot in use by the replay's own requests:
    its slots filled with the replay's prompts in order, each row stepped to its answer's
    length, then freed and refilled with the next request's prompt (prefills untimed).
    Only steps with every slot in use are timed, each reading its tokens back (as
    ``steady_decode``'s do). So a step attends the positions the replay's rows hold, which
    at the long replay's prompts reads far more cache than ``steady_decode``'s short fill:
    the ceiling's decode step. ``answers``: each request's answer length (default: its
    max_tokens)."""
    slots = model.slots(bucket)
    b = slots.batch
    todo = deque(
        (p, max(1, n))
        for (p, g), n in zip(work, answers or [g for _, g in work], strict=True)
        if model.tokens_needed(len(p), g) <= bucket.seq
    )
    left: dict[int, int] = {}  # slot -> steps still to go

    def fill(slot: int) -> None:
        p, n = todo.popleft()
        slots.prefill(slot, p)  # the first token
        left[slot] = n - 1

    timed, secs, rows_stepped = 0, 0.0, 0
    try:
        for r in range(b):
            if todo:
                fill(r)
        while left:
            for r in [r for r, n in left.items() if n <= 0]:  # answers done: refill
                del left[r]
                slots.free(r)
                if todo:
                    fill(r)
            if len(left) < b:
                break  # the replay ran out: the rest steps fewer rows than the bucket holds
            rows = sorted(left)
            _sync(model.device)
            t0 = time.perf_counter()
            slots.step(rows)  # reads the tokens back: a host sync per step
            secs += time.perf_counter() - t0
            timed += 1
            rows_stepped += len(rows)
            for r in rows:
                left[r] -= 1
    finally:
        for r in left:
            slots.free(r)
    if not timed:
        return {"batch": b, "seq": bucket.seq, "error": "the replay never filled every slot"}
    return {
        "batch": b,
        "seq": bucket.seq,
        "steps": timed,
        "step_ms": secs / timed * 1e3,
        "tokens_per_s": rows_stepped / secs,
    }


def _home(model: Any, need: int) -> Any:
    """The bucket of the largest batch whose length holds ``need`` positions (the shortest
    such length on a tie)."""
    fits = [b for b in model.buckets if b.seq >= need]
    return max(fits, key=lambda b: (b.batch, -b.seq))


def _positions(slots: Any, n: int) -> int:
    """Positions a prefill of n tokens computes in these slots."""
    f = getattr(slots, "prefill_positions", None)
    return int(f(n)) if f is not None else slots.seq


def prefill_alone(model: Any, work: Work, reps: int) -> dict[str, Any]:
    """Each request's prompt prefilled alone, in slot 0 of the bucket of the largest batch
    whose length holds prompt + answer (the shortest such length on a tie); the best of
    ``reps`` per distinct prompt, after one untimed prefill of each (bucket, prefill length)."""

    def home(p: list[int], g: int) -> Any:
        return _home(model, model.tokens_needed(len(p), g))

    positions = _positions
    warmed: set = set()
    best: dict[tuple, float] = {}
    per_request = []
    by_bucket: dict[str, dict[str, float]] = {}
    for p, g in work:
        bucket = home(p, g)
        slots = model.slots(bucket)
        key = (bucket, tuple(p))
        if key not in best:
            length = positions(slots, len(p))
            if (bucket, length) not in warmed:
                slots.prefill(0, p)
                slots.free(0)
                warmed.add((bucket, length))
            t = float("inf")
            for _ in range(reps):
                _sync(model.device)
                t0 = time.perf_counter()
                slots.prefill(0, p)  # returns the first token: a host sync
                t = min(t, time.perf_counter() - t0)
                slots.free(0)
            best[key] = t
        per_request.append(best[key])
        agg = by_bucket.setdefault(bucket.name, {"prefills": 0, "seconds": 0.0})
        agg["prefills"] += 1
        agg["seconds"] += best[key]
    return {"seconds": sum(per_request), "per_request_s": per_request, "by_bucket": by_bucket}


def burst_shared(model: Any, work: Work, clients: list[int], reps: int) -> dict[str, Any]:
    """The opening burst's floor with shared prefill calls: the first ``c`` prompts (as many
    as the largest batch holds) prefilled together into one bucket's slots, split into calls
    as ``serve --prefill-merge auto`` would split them (by that bucket's measured call
    costs), the best of ``reps``. The last first token of the burst comes no sooner."""
    from pipeline.server.placement import prefill_calls
    from pipeline.server.prefill_costs import measure

    out: dict[str, Any] = {}
    for c in (c for c in clients if c > 1):
        bucket = _home(model, max(model.tokens_needed(len(p), g) for p, g in work[:c]))
        slots = model.slots(bucket)
        first = work[: min(c, bucket.batch)]
        costs = measure(slots)
        items = [(_positions(slots, len(p)), p, i) for i, (p, _) in enumerate(first)]
        size = int(getattr(slots, "prefill_batch", 1)) if costs else 1
        calls = prefill_calls(items, size, 0, costs)  # no costs: one prompt a call
        timed = []
        for rep in range(max(reps, 1) + 1):  # the first untimed
            _sync(model.device)
            t0 = time.perf_counter()
            for _, group in calls:
                rows, prompts = [i for _, _, i in group], [p for _, p, _ in group]
                if len(rows) > 1:
                    slots.prefill_many(rows, prompts)
                else:
                    slots.prefill(rows[0], prompts[0])
            if rep:
                timed.append(time.perf_counter() - t0)
            for _, _, i in items:
                slots.free(i)
        best = min(timed)
        out[str(c)] = {
            "prompts": len(first),
            "bucket": bucket.name,
            "calls": len(calls),
            "seconds": best,
        }
    return out


def measure_release(release: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The replay's requests, their answers alone, the steady decode rates and the prefills
    alone; the model is gone (and its device memory given back) when this returns."""
    from pipeline.runtime import BucketedModel

    t = time.perf_counter()
    model = BucketedModel.load(release)
    model.warmup()
    secs = time.perf_counter() - t
    log(f"loaded and warmed {model.manifest.model} on {model.device} in {secs:.1f} s")
    if args.scale_to is not None and not 1 < args.scale_to <= model.max_seq:
        sys.exit(f"error: --scale-to {args.scale_to}: the largest bucket holds {model.max_seq}")
    work = workload(args.trace, model, args.requests, args.seed, args.scale_to)
    alone = None
    if args.alone:
        t = time.perf_counter()
        alone = [model.generate([p], g)[0] for p, g in work]  # the truth: each prompt alone
        log(f"{len(work)} answers alone in {time.perf_counter() - t:.1f} s")
    out: dict[str, Any] = {
        "work": work,
        "alone": alone,
        "model": model.manifest.model,
        "version": model.manifest.version,
        "device": model.device,
        "buckets": [b.name for b in model.buckets],
        "max_batch": model.max_batch,
        "max_seq": model.max_seq,
        "vocab": model.vocab_size(),
        # tokens_needed(p, g) = p + g + plus (peer_serve.py --tokens-needed-plus)
        "tokens_needed_plus": model.tokens_needed(100, 10) - 110,
    }
    steady: dict[str, Any] = {}
    for bucket in model.buckets:
        try:
            steady[bucket.name] = steady_decode(
                model, bucket, args.decode_steps, args.decode_prompt
            )
        except Exception as e:
            steady[bucket.name] = {"batch": bucket.batch, "seq": bucket.seq, "error": repr(e)}
        log(f"steady decode {bucket.name}: {steady[bucket.name]}")
    out["steady_decode"] = steady
    # the ceiling's decode step: the largest batch's bucket that holds the replay, its
    # slots kept full by the replay's own requests (answers alone: their real lengths)
    largest = max(model.buckets, key=lambda b: (b.batch, b.seq))
    try:
        t = time.perf_counter()
        lengths = [len(a) for a in alone] if alone is not None else None
        out["replay_decode"] = replay_decode(model, largest, work, lengths)
        log(
            f"replay decode {largest.name}: {out['replay_decode']} "
            f"(measured in {time.perf_counter() - t:.1f} s)"
        )
    except Exception as e:
        out["replay_decode"] = {"batch": largest.batch, "seq": largest.seq, "error": repr(e)}
        log(f"replay decode failed: {e!r}")
    try:
        t = time.perf_counter()
        out["prefill_alone"] = prefill_alone(model, work, args.prefill_reps)
        log(
            f"prefills alone: {out['prefill_alone']['seconds']:.3f} s for {len(work)} requests "
            f"(measured in {time.perf_counter() - t:.1f} s)"
        )
    except Exception as e:
        out["prefill_alone"] = {"error": repr(e)}
        log(f"prefills alone failed: {e!r}")
    try:
        clients = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
        out["burst_shared"] = burst_shared(model, work, clients, args.prefill_reps)
        log(f"opening bursts, shared prefill calls: {out['burst_shared']}")
    except Exception as e:
        out["burst_shared"] = {"error": repr(e)}
        log(f"opening bursts, shared prefill calls, failed: {e!r}")
    del model
    return out


def free_device(device: str) -> dict[str, Any]:
    gc.collect()
    if device != "cuda":
        return {}
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {
        "allocated_bytes": torch.cuda.memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(),
    }


def ceiling(measured: dict[str, Any], out_tokens: int, requests: int) -> dict[str, Any]:
    """Every prefill alone + the other tokens at the largest batch's step time per row, that
    step timed with the replay's own requests in every slot (``replay_decode``); the same
    with ``steady_decode``'s short-fill step beside it (``short_fill``: the ceiling of
    rounds before the fifteenth, whose steps attend ~100 positions, fewer than any step of
    a replay of long prompts)."""
    steady = measured["steady_decode"]
    prefill = measured["prefill_alone"]
    largest = [
        (name, s)
        for name, s in steady.items()
        if s.get("batch") == measured["max_batch"] and "step_ms" in s
    ]
    if not largest or "seconds" not in prefill:
        return {"error": "no steady decode figure of the largest batch, or no prefill figures"}

    def at(step: dict[str, Any]) -> dict[str, Any]:
        decode_s = (out_tokens - requests) * step["step_ms"] / 1e3 / step["batch"]
        seconds = prefill["seconds"] + decode_s
        return {
            "step_ms": step["step_ms"],
            "prefill_seconds": prefill["seconds"],
            "decode_seconds": decode_s,
            "seconds": seconds,
            "output_tokens_per_s": out_tokens / seconds,
            "requests_per_s": requests / seconds,
        }

    name, step = min(largest, key=lambda kv: kv[1]["step_ms"])
    short = {"decode_bucket": name, **at(step)}
    replay = measured.get("replay_decode") or {}
    if "step_ms" not in replay:
        return {**short, "decode_at": "short fill", "replay_decode_error": replay.get("error")}
    return {
        "decode_bucket": f"b{replay['batch']}_s{replay['seq']}",
        "decode_at": "the replay's own rows",
        **at(replay),
        "short_fill": short,
    }


# --- the servers ---------------------------------------------------------------------------------


def serve_ways(
    release: Path,
    batching: str,
    ways: list[tuple[str, int]],
    work: Work,
    alone: list[list[int]],
    buckets: list[str],
    args: argparse.Namespace,
    tmp: Path,
    keep: Any,
    errors: list[str],
) -> Iterator[None]:
    """Start the server ``batching`` names in SERVERS, run each (way, concurrency)
    ``--rounds`` times (``keep`` gets every measurement), stop it; its errors go into
    ``errors``. A generator: it yields once the server is ready and after each round, so
    that ``run_servers`` can take the servers' rounds in turn."""
    extra = list(SERVERS[batching]) if batching in SERVERS else list(args.variants[batching])
    most = max(c for _, c in ways)
    if most > 256:  # the server's default --max-queue
        extra += ["--max-queue", str(most)]
    extra += args.serve_arg
    mine: list[str] = []
    logfile = tmp / f"serve-{batching}.log"
    log(f"starting serve {' '.join(extra)}")
    timeline = None
    env, entry, first = None, None, ""
    if args.device_timeline:  # every slot call timed on the device: bench/device_timeline.py
        timeline = args.device_timeline / f"{batching}-{time.strftime('%H%M%S')}"
        timeline.mkdir(parents=True)
        env = {"INF2_DEVICE_TIMELINE": str(timeline)}
        first = f"import sys; sys.path.insert(0, {str(HERE)!r}); "
        first += "import device_timeline as t; t.install(); "
    if args.server_cpus:  # before any fork: the engine's process and the fronts inherit it
        first = f"import os; os.sched_setaffinity(0, {sorted(args.server_cpus)!r}); " + first
    if first:
        entry = [sys.executable, "-c", first + "from pipeline.cli import main; main()", "serve"]
    server = ServerProcess(release, logfile, *extra, env=env, entry=entry)
    measured: list[tuple[str, int, int, dict[str, Any], float, float]] = []
    ready = False
    try:
        t = time.perf_counter()
        url = server.wait_ready(args.ready_timeout)  # raises with the log's tail
        ready = True
        log(f"serve --batching {batching} ready in {time.perf_counter() - t:.1f} s at {url}")
        startup = startup_seconds(scrape(url))
        log("  its start-up, s: " + ", ".join(f"{p} {s:.1f}" for p, s in startup.items()))
        name = json.loads(get(url + "/v1/models")[1])["data"][0]["id"]
        if args.warmup_requests:
            w = work[: args.warmup_requests]
            _, _, errs = replay(url, name, w, min(most, len(w)), args.request_timeout)
            if errs:
                mine += [f"warm-up: {e}" for e in errs[:3]]
        yield  # ready: run_servers may start the next server before the first round
        for r in range(args.rounds):
            if r:
                yield  # a round done: another server's may come first
            for (way, conc), procs in itertools.product(ways, args.client_procs):
                if conc == 1 and procs != args.client_procs[0]:
                    continue  # one client is one thread: once is enough
                label = way if procs == 1 or conc == 1 else f"{way}/{procs}p"
                before = scrape(url)
                sampling = SAMPLED if way == "sampled" else None
                sent = work  # the lone way: the first --lone-requests of them
                if way == "lone" and args.lone_requests:
                    sent = work[: args.lone_requests]
                due = None  # closed loop, or open at --rate (the lone request stays alone)
                if args.rate and way != "lone":
                    due = poisson_arrivals(len(work), args.rate, args.seed)
                clients: dict[str, float] = {}
                speed = host_probe.python_speed()  # the host just before (0.3-0.8 s)
                host0 = host_probe.snapshot(server.proc.pid)
                t0 = time.monotonic()
                wall, answers, errs = replay(
                    url,
                    name,
                    sent,
                    conc,
                    args.request_timeout,
                    sampling,
                    due,
                    procs,
                    args.client_cpus,
                    clients,
                )
                t1 = time.monotonic()
                host = host_probe.delta(host0, host_probe.snapshot(server.proc.pid), t1 - t0)
                host["python_s"] = speed
                host["clients"] = {
                    "cpus": clients["cpu_s"] / (t1 - t0),
                    "involuntary_per_s": clients["involuntary"] / (t1 - t0),
                }
                log(f"  {label}: " + host_probe.summary(host))
                after = scrape(url)
                # sampled answers are draws, not the greedy answer alone: not compared
                truth = None if sampling or alone is None else alone[: len(sent)]
                figures = way_figures(
                    sent, truth, wall, answers, errs, server_figures(before, after, buckets), conc
                )
                figures["server_startup_s"] = startup
                figures["started_s"] = round(t0 - BENCH_START, 2)  # when in the run
                figures["host"] = host
                if timeline is None:
                    keep(label, batching, conc, r, figures)
                else:  # the device's account comes when the engine stops
                    measured.append((label, conc, r, figures, t0, t1))
    except Exception as e:
        mine.append(f"serve --batching {batching}: {type(e).__name__}: {e}")
    finally:
        rc = server.stop()
        if rc != 0:
            mine.append(f"serve --batching {batching} exited {rc}")
        if timeline is not None:
            import device_timeline

            calls = device_timeline.load(timeline)
            for way, conc, r, figures, t0, t1 in measured:
                figures["device"] = device_timeline.summarize(calls, t0, t1)
                keep(way, batching, conc, r, figures)
        if mine and ready:
            mine.append("server log tail:\n" + server.output()[-2000:])
        if args.json:  # beside the figures: the server's own account
            keep_log = args.json.with_name(f"{args.json.stem}.serve-{batching}.log")
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(logfile, keep_log)
        for e in mine:
            log(f"error: {e}")
        errors += mine


def run_servers(servers: list[Iterator[None]], interleave: bool, save: Callable[[], None]) -> None:
    """Each server's rounds (``serve_ways``): one server after another, or with
    ``interleave`` every server started first and then round 1 of each in turn, round 2 of
    each, ..., so that a host that slows or speeds up within the run (the thirty-fourth
    round's host ran Python 1.6x slower 13 s later) weighs on every server alike, not on
    whichever ran last. Interleaved servers are resident together: each holds its release
    and its KV caches on the device. Whatever ends this early stops every server started."""
    try:
        if not interleave:
            for server in servers:
                for _ in server:
                    save()
            return
        live = list(servers)
        while live:
            for server in list(live):
                if next(server, StopIteration) is StopIteration:
                    live.remove(server)
                save()
    finally:
        for server in servers:  # a suspended one stops its server (serve_ways' finally)
            server.close()


def run_peer(
    peer: Path, trace: Path, seq: int, work: Work, conc: int, plus: int, args: argparse.Namespace
) -> dict[str, Any]:
    cmd = [sys.executable, str(peer), "--trace", str(trace), "--max-seq", str(seq)]
    cmd += ["--requests", str(len(work)), "--concurrency", str(conc), "--seed", str(args.seed)]
    cmd += ["--tokens-needed-plus", str(plus), *args.peer_arg]
    log(f"peer: {' '.join(cmd)}")
    out: dict[str, Any] = {"command": cmd, "concurrency": conc}
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        out["error"] = f"no answer in {args.peer_timeout} s"
        return out
    out["wall_seconds"] = time.perf_counter() - t
    if p.returncode != 0:
        out["error"] = f"exit {p.returncode}: {p.stderr[-1500:]}"
        return out
    lines = p.stdout.splitlines(keepends=True)
    for k, line in enumerate(lines):  # its JSON is the last thing it prints
        if line.startswith("{"):
            try:
                out["result"] = json.loads("".join(lines[k:]))
                break
            except json.JSONDecodeError:
                continue
    else:
        out["error"] = f"no JSON in its output: {p.stdout[-500:]!r}"
        return out
    res = out["result"]
    out["same_lengths"] = res.get("requests") == len(work) and res.get(
        "asked_output_tokens"
    ) == sum(g for _, g in work)
    return out


# --- the report ----------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def _x(a: float | None, b: float | None) -> str:
    return "—" if not a or not b else f"{a / b:.2f}×"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


COLUMNS = (  # (heading, width); the first is left-aligned
    ("way", 24),
    ("conc", 4),
    ("req/s", 7),
    ("tok/s", 9),
    ("×static", 7),
    ("×ceil", 6),
    ("TTFT50", 7),
    ("TTFT99", 7),
    ("99/lone", 7),
    ("99/l99", 6),
    ("TTFT99+", 7),
    ("ITL50", 6),
    ("ITL99", 6),
    ("occup", 6),
    ("prefill", 7),
    ("steps", 6),
    ("differ", 6),
)


def _row(cells: list[str]) -> str:
    first, *rest = zip(cells, COLUMNS, strict=False)
    return " ".join([f"{first[0]:<{first[1][1]}}"] + [f"{c:>{w}}" for c, (_, w) in rest])


def print_table(result: dict[str, Any]) -> None:
    w = result["workload"]
    print()
    print(
        f"{w['requests']} requests from {w['trace']} (seed {w['seed']}, p95 scaled to "
        f"{w['scale_to']} positions): {w['prompt_tokens']} prompt and {w['output_tokens']} "
        f"output tokens. {result['model']} {result['version']} on {result['device_name']}, "
        f"buckets {', '.join(result['buckets'])}; best of {result['rounds']} round(s); "
        f"arrivals: {w.get('arrivals', 'closed loop')}."
    )
    for name, s in result["steady_decode"].items():
        if "tokens_per_s" in s:
            print(
                f"steady decode {name}: {s['step_ms']:.3f} ms/step, {s['tokens_per_s']:,.0f} tok/s"
            )
        else:
            print(f"steady decode {name}: {s.get('error')}")
    c = result.get("ceiling", {})
    ceil = c.get("output_tokens_per_s")
    if ceil:
        print(
            f"ceiling: {ceil:,.1f} tok/s: {w['output_tokens']} tokens in {c['seconds']:.3f} s "
            f"(prefills alone {c['prefill_seconds']:.3f} s + decode {c['decode_seconds']:.3f} s "
            f"at {c['step_ms']:.3f} ms per {c['decode_bucket']} step, {c['decode_at']})"
        )
        if "short_fill" in c:
            sf = c["short_fill"]
            print(
                f"  at the short fill's step ({sf['step_ms']:.3f} ms, the rounds before the "
                f"fifteenth): {sf['output_tokens_per_s']:,.1f} tok/s"
            )
    else:
        print(f"ceiling: {c.get('error')}")
    for c, floor in (result.get("burst_prefills_alone_s") or {}).items():
        if floor and int(c) > 1:
            print(
                f"opening burst at {c} clients: its {c} prefills alone take {floor * 1e3:.1f} "
                "ms, the floor of the last first token's TTFT (shared prefill calls aside)"
            )
    for c, floor in (result.get("burst_prefills_shared") or {}).items():
        if isinstance(floor, dict):
            print(
                f"opening burst at {c} clients, shared calls: its first {floor['prompts']} "
                f"prompts in {floor['calls']} prefill calls take {floor['seconds'] * 1e3:.1f} ms"
            )
    ways = result["ways"]
    static = {r["concurrency"]: r["output_tokens_per_s"] for r in ways if r["batching"] == "static"}
    lone_way = next((r for r in ways if r["way"] == "lone"), None)
    lone = lone_way["ttft_p50_s"] if lone_way else None
    lone99 = lone_way["ttft_p99_s"] if lone_way else None
    labels = {
        "lone": "lone request (serve)",
        "serve": "serve",
        "thread": "serve --no-engine-process",
        "serial": "serve --no-overlap",
        "sampled": "serve, T 0.7 top_p 0.9",
        "static": "serve --batching static",
    }
    print()
    print(_row([h for h, _ in COLUMNS]))
    for r in ways:
        tps = r["output_tokens_per_s"]
        print(
            _row(
                [
                    labels.get(r["way"], r["way"]),
                    str(r["concurrency"]),
                    f"{r['requests_per_s']:.1f}",
                    f"{tps:.1f}",
                    _x(tps, static.get(r["concurrency"])),
                    _x(tps, ceil),
                    _ms(r["ttft_p50_s"]),
                    _ms(r["ttft_p99_s"]),
                    _x(r["ttft_p99_s"], lone),
                    _x(r["ttft_p99_s"], lone99),
                    _ms(r.get("ttft_p99_after_burst_s")),
                    _ms(r["itl_p50_s"]),
                    _ms(r["itl_p99_s"]),
                    _pct(r["slot_occupancy"]),
                    _pct(r["prefill_padding_efficiency"]),
                    str(r["steps"]),
                    str(r["answers_differing_from_alone"]),
                ]
            )
        )
    print(
        "\nthe model thread's seconds in each way (from /metrics): wait for work / inside "
        "prefill calls / inside step calls / the engine's own work around them"
    )
    for r in ways:
        e = r.get("engine_seconds") or {}
        parts = " / ".join(f"{e.get(k, 0.0):.3f}" for k in ("wait", "prefill", "step", "other"))
        name = labels.get(r["way"], r["way"])
        print(f"  {name:<24} {r['concurrency']:>4}  {parts}  (wall {r['seconds']:.3f})")
    print(
        "\nTTFT p50 / p99 ms in each way: the server's (arrival at the front to the engine's "
        "token; /metrics, interpolated in its buckets), of it the wait to be admitted; the "
        "front's admission before arrival (route to queue) and its first write after it "
        "(arrival to the event on the socket); the client's; and how late the front's event "
        "loop woke a task due (sampled every 10 ms: about what anything ready waited for it)"
    )
    for r in ways:
        name = labels.get(r["way"], r["way"])
        server, queue, admission, written, client, lag = (
            " / ".join(_ms(r.get(f"{key}_p{q}_s")) for q in (50, 99))
            for key in (
                "server_ttft",
                "server_queue",
                "server_admission",
                "server_written",
                "ttft",
                "server_loop_lag",
            )
        )
        print(
            f"  {name:<24} {r['concurrency']:>4}  server {server} (queue {queue}), admission "
            f"{admission}, written {written}, client {client}; loop lag {lag}"
        )
    probed = [r for r in ways if r.get("host")]
    if probed:
        print(
            "\nwhere the host's CPUs went in each way (bench/host_probe.py; CPUs = seconds a "
            "second): the machine busy and stolen by the hypervisor; the front's event loop "
            "on a CPU and runnable but waiting for one, and how often it was preempted; each "
            "server process; the clients"
        )
    for r in probed:
        name = labels.get(r["way"], r["way"])
        print(f"  {name:<24} {r['concurrency']:>4}  {host_probe.summary(r['host'], '')}")
    timed = [r for r in ways if (r.get("device") or {}).get("calls")]
    if timed:
        print(
            "\nthe device in each way (CUDA events around every slot call): busy / wall, "
            "mean call ms, gaps between calls, of them the host launching the next call"
        )
    for r in timed:
        d = r["device"]
        means = ", ".join(f"{k} {v:.3f}" for k, v in sorted(d["mean_ms_by_kind"].items()))
        name = labels.get(r["way"], r["way"])
        print(
            f"  {name:<24} {r['concurrency']:>4}  busy {d['device_busy_s']:.3f} / "
            f"{d['wall_s']:.3f} s ({d['device_busy_fraction']:.0%}); {means} ms; {d['gaps']} gaps "
            f"{d['gap_s']:.3f} s (p50 {d['gap_p50_ms']:.3f}, p99 {d['gap_p99_ms']:.3f} ms), "
            f"launching {d['gap_s_host_launching_next']:.3f} s; host in reads "
            f"{d['host_in_reads_s']:.3f} s, launching "
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(d["host_launch_s_by_kind"].items()))
            + " s"
        )
    for p in result.get("peer", []):
        conc = str(p["concurrency"])
        runs = p.get("result", {}).get("runs", [])
        if "error" in p or not runs:
            print(_row(["peer hf-cb", conc]) + f" error: {p.get('error', 'no runs')[:200]}")
        for run in runs:
            label = f"peer hf-cb ({run.get('attn', '?')})"
            if "error" in run:
                print(_row([label, conc]) + f" error: {run['error'][:200]}")
                continue
            tps = run["output_tokens_per_s"]
            cells = [label, conc, f"{run['requests_per_s']:.1f}", f"{tps:.1f}"]
            cells += [_x(tps, static.get(p["concurrency"])), _x(tps, ceil)]
            print(
                _row(cells) + f"  (whole-request latency p50 {_ms(run.get('p50_latency_s'))} ms, "
                f"p99 {_ms(run.get('p99_latency_s'))} ms)"
            )
    print(
        "\nTTFT (time to first token) and ITL (inter-token latency) in ms, at the client; "
        "99/lone, 99/l99: p99 TTFT ÷ the lone request's TTFT p50, p99; TTFT99+: p99 of the "
        "requests after "
        "each client's first (the opening burst, all at once);\noccup: decode rows in use ÷ rows "
        "stepped; prefill: prompt tokens ÷ prefill positions; differ: answers unlike the "
        "prompt alone"
    )
    print_round_ratios(ways, labels)


def print_round_ratios(ways: list[dict[str, Any]], labels: dict[str, str]) -> None:
    """With --rounds, each round's p99 TTFT ÷ the lone request's p99 in that round: the
    headline row is the fastest round only, and a p99 goal holds or not round by round."""
    lone = next((r for r in ways if r["way"] == "lone"), None)
    base = [x.get("ttft_p99_s") for x in (lone or {}).get("every_round", [])]
    if len(base) < 2:
        return
    print("\np99 TTFT ÷ the lone request's p99 in the same round, round by round:")
    for r in ways:
        if r is lone:
            continue
        rounds = zip(r.get("every_round", []), base, strict=False)  # a way cut short: fewer
        cells = [_x(x.get("ttft_p99_s"), b) for x, b in rounds]
        name = labels.get(r["way"], r["way"])
        print(f"  {name:<24} {r['concurrency']:>4}  " + " ".join(cells))


# --- the run -------------------------------------------------------------------------------------


def cpu_list(spec: str) -> set[int]:
    """'0-7' or '0,2,4-6' (taskset's list form) as a set of CPU numbers."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi if dash else lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: CPU numbers and ranges, e.g. 0-7,12") from None
    bad = cpus - os.sched_getaffinity(0)
    if not cpus or bad:
        raise argparse.ArgumentTypeError(f"{spec!r}: not CPUs this process may use")
    return cpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("release", type=Path, help="DEST/MODEL, e.g. pulled/tiny-llama (make demo)")
    ap.add_argument(
        "--trace", type=Path, default=next((t for t in TRACES if t.is_file()), TRACES[0])
    )
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument(
        "--concurrency", default="32", help="client threads, or a comma-separated list: 32,64"
    )
    ap.add_argument(
        "--scale-to",
        type=int,
        metavar="SEQ",
        help="positions the trace's p95 request is scaled to (default: the largest bucket)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of each way; the fastest is the headline, every round's figures are in "
        "the JSON (every_round)",
    )
    ap.add_argument(
        "--interleave-servers",
        action="store_true",
        help="start every server (way, variant) first, then run round 1 of each in turn, "
        "round 2 of each, ...: comparisons across servers meet the host alike (each holds its "
        "release on the device meanwhile)",
    )
    ap.add_argument(
        "--ways",
        default=",".join(WAYS),
        help=f"the server ways to run, of {','.join(WAYS)}; none: only the in-process figures "
        "(and --peer), without answers alone",
    )
    ap.add_argument(
        "--rate",
        type=float,
        help="open loop: requests arrive as a Poisson process of this many a second (TTFT at "
        "a load below saturation), sent from --concurrency client connections; the lone "
        "request stays one at a time. Default: closed loop (each client sends its next "
        "request when its last one ends)",
    )
    ap.add_argument(
        "--client-procs",
        default="1",
        help="the client threads spread over this many processes (a comma-separated list "
        "measures each way once per value, in the same server: 'serve/4p' is serve with "
        "4); more than 1 keeps the clients' own GIL out of the times they stamp",
    )
    ap.add_argument(
        "--lone-requests",
        type=int,
        metavar="N",
        help="the lone way sends only the first N requests (its p50 and p99 need far fewer "
        "than a replay whose p99 should lie past the opening burst: at 32 clients, more "
        "than 3,200; one at a time on an H100, 2,000 took 33 s). Default: all",
    )
    ap.add_argument("--json", type=Path, help="write every figure here (after every stage)")
    ap.add_argument(
        "--tolerate-mismatch",
        action="store_true",
        help="count answers that differ from the prompt alone instead of failing (bf16 on a "
        "GPU: kernels of different batch shapes may round differently)",
    )
    ap.add_argument(
        "--skip-alone",
        action="store_true",
        help="do not generate each prompt's answer alone first: no answer is compared, and "
        "the ceiling counts every request's max_tokens (what a random-weight model answers "
        "anyway: it meets no EOS). For a device call short of time",
    )
    ap.add_argument("--decode-steps", type=int, default=100, help="timed steps per bucket")
    ap.add_argument(
        "--decode-prompt",
        type=int,
        default=8,
        help="prompt tokens per slot before the steady decode steps (at most a quarter of "
        "the bucket): the filled length that its step attends",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="one more server: the default one with these serve flags (e.g. "
        "'prefills8=--max-prefills 8'), at every --concurrency, after the ways (repeatable)",
    )
    ap.add_argument(
        "--device-timeline",
        type=Path,
        help="a folder: every server's slot calls timed with CUDA events "
        "(bench/device_timeline.py), each way's device busy time and gaps in its figures",
    )
    ap.add_argument("--prefill-reps", type=int, default=2, help="timings per prompt; best kept")
    ap.add_argument(
        "--warmup-requests",
        type=int,
        help="requests sent to each server before measuring (default: the largest concurrency)",
    )
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an argument for both servers, e.g. --serve-arg=--max-prefills=8 (repeatable)",
    )
    ap.add_argument(
        "--server-cpus",
        type=cpu_list,
        help="CPUs the server's processes run on, e.g. 0-7 (as on a pod, apart from its "
        "clients; default: any)",
    )
    ap.add_argument(
        "--client-cpus",
        type=cpu_list,
        help="CPUs the client processes run on, e.g. 8-15 (with --client-procs > 1)",
    )
    ap.add_argument("--ready-timeout", type=float, default=900, help="s for a server to be ready")
    ap.add_argument("--request-timeout", type=float, default=600, help="s of socket silence")
    ap.add_argument(
        "--peer", type=Path, help="peer_serve.py (../shared/peers/hf-continuous-batching)"
    )
    ap.add_argument(
        "--peer-arg",
        action="append",
        default=[],
        help="an argument for the peer, e.g. --peer-arg=--device=cpu --peer-arg=--tiny",
    )
    ap.add_argument("--peer-timeout", type=float, default=1200, help="s for each peer run")
    args = ap.parse_args()
    try:
        args.client_procs = sorted({int(c) for c in args.client_procs.split(",") if c.strip()})
    except ValueError:
        args.client_procs = [0]
    if not args.client_procs or min(args.client_procs) < 1:
        sys.exit(f"error: --client-procs {args.client_procs}: counts of processes, 1 or more")
    if args.lone_requests is not None and args.lone_requests < 1:
        sys.exit(f"error: --lone-requests {args.lone_requests}: a count of requests, 1 or more")
    concs = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    chosen = [w.strip() for w in args.ways.split(",") if w.strip() not in ("", "none")]
    bad = [w for w in chosen if w not in WAYS]
    if not concs or min(concs) < 1 or bad:
        sys.exit(f"error: --concurrency {args.concurrency} --ways {args.ways}: bad value {bad}")
    args.variants = {}
    for v in args.variant:
        label, _, flags = v.partition("=")
        if not label or label in WAYS or label in SERVERS or label in args.variants or not flags:
            sys.exit(f"error: --variant {v!r}: want a new LABEL=FLAGS, e.g. 'p8=--max-prefills 8'")
        args.variants[label] = ["--batching", "iteration", *shlex.split(flags)]
    variants = list(args.variants)
    if args.peer is not None and not args.peer.is_file():
        sys.exit(f"error: --peer {args.peer}: no such file")
    if not args.trace.is_file():
        sys.exit(f"error: --trace {args.trace}: no such file (copy {TRACE_NAME} there)")
    try:
        find_release(args.release)
    except InputError as e:
        sys.exit(f"error: {e}")
    if args.warmup_requests is None:
        args.warmup_requests = min(args.requests, max(concs))
    # the servers' answers are checked against these
    args.alone = bool(chosen) and not args.skip_alone

    import torch

    measured = measure_release(args.release, args)
    memory = free_device(measured["device"])
    work, alone = measured["work"], measured["alone"]
    # without answers alone (--ways none, --skip-alone): every request its max_tokens (no EOS)
    out_tokens = sum(len(a) for a in alone) if alone else sum(g for _, g in work)
    device_name = (
        torch.cuda.get_device_name()
        if measured["device"] == "cuda"
        else platform.processor() or "cpu"
    )
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    result: dict[str, Any] = {
        "bench": "serve",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "release": str(args.release),
        "model": measured["model"],
        "version": measured["version"],
        "device": measured["device"],
        "device_name": device_name,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": tf_version,
        },
        "buckets": measured["buckets"],
        "workload": {
            "trace": args.trace.name,
            "seed": args.seed,
            "requests": len(work),
            "scale_to": args.scale_to or measured["max_seq"],
            "prompt_tokens": sum(len(p) for p, _ in work),
            "asked_output_tokens": sum(g for _, g in work),
            "output_tokens": out_tokens,
            "output_tokens_are": "the answers alone"
            if alone
            else f"max_tokens ({'--skip-alone' if args.skip_alone else '--ways none'})",
            "arrivals": f"open loop, Poisson at {args.rate}/s" if args.rate else "closed loop",
        },
        "rounds": args.rounds,
        "answers_compared_with_alone": alone is not None,
        "serve_args": args.serve_arg,
        "device_memory_after_freeing": memory,
        "steady_decode": measured["steady_decode"],
        "prefill_alone": {
            k: v for k, v in measured["prefill_alone"].items() if k != "per_request_s"
        },
        "ceiling": ceiling(measured, out_tokens, len(work)),
        # the opening burst's floor: every client's first request arrives at once, so the
        # last of them to get its first token waits for all their prefills
        "burst_prefills_alone_s": {
            str(c): sum(measured["prefill_alone"].get("per_request_s", [])[:c]) for c in concs
        },
        "burst_prefills_shared": measured.get("burst_shared"),
        "replay_decode": measured.get("replay_decode"),
        "ways": [],
        "errors": [],
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")

    save()
    best: dict[tuple[str, int], dict[str, Any]] = {}
    mismatches: dict[tuple[str, int], int] = {}
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def keep(way: str, batching: str, conc: int, rnd: int, figures: dict[str, Any]) -> None:
        key = (way, conc)
        mismatches[key] = mismatches.get(key, 0) + figures["answers_differing_from_alone"]
        log(
            f"{way} ({batching}) × {conc}, round {rnd + 1}: {figures['output_tokens_per_s']:,.1f} "
            f"tok/s, TTFT p50/p99 {_ms(figures['ttft_p50_s'])}/{_ms(figures['ttft_p99_s'])} ms, "
            f"ITL p50/p99 {_ms(figures['itl_p50_s'])}/{_ms(figures['itl_p99_s'])} ms, occupancy "
            f"{_pct(figures['slot_occupancy'])}, {figures['steps']} steps, "
            f"{figures['answers_differing_from_alone']} differing, "
            f"{figures['failed_requests']} failed"
        )
        if figures["errors"]:
            result["errors"] += [f"{way} × {conc}: {e}" for e in figures["errors"]]
        if key not in best or figures["seconds"] < best[key]["seconds"]:
            best[key] = {"way": way, "batching": batching, "concurrency": conc, **figures}
        # every round's headline figures too: the spread the fastest alone hides
        rounds.setdefault(key, []).append({k: figures.get(k) for k in ROUND_FIGURES})
        result["ways"] = [
            {**best[k], "answers_differing_from_alone": mismatches[k], "every_round": rounds[k]}
            for k in sorted(best, key=order)
        ]
        save()

    def order(key: tuple[str, int]) -> tuple[int, int, str]:
        way, procs = key[0].partition("/")[::2]  # serve/4p: serve with 4 client processes
        rank = WAYS.index(way) if way in WAYS else len(WAYS) + variants.index(way)
        return (rank, key[1], procs)

    plan: list[tuple[str, list[tuple[str, int]]]] = []
    iteration = ([("lone", 1)] if "lone" in chosen else []) + (
        [("serve", c) for c in concs if c > 1 or "lone" not in chosen] if "serve" in chosen else []
    )
    iteration += [("sampled", c) for c in concs] if "sampled" in chosen else []
    if iteration:
        plan.append(("iteration", iteration))
    if "thread" in chosen:
        plan.append(("thread", [("thread", c) for c in concs]))
    if "serial" in chosen:
        plan.append(("serial", [("serial", c) for c in concs]))
    if "static" in chosen:
        plan.append(("static", [("static", c) for c in concs]))
    for label in variants:  # the default server with more flags, at the serve way's clients
        plan.append((label, [(label, c) for c in concs]))
    with tempfile.TemporaryDirectory() as tmp:
        servers = [
            serve_ways(
                args.release,
                batching,
                ways,
                work,
                alone,
                measured["buckets"],
                args,
                Path(tmp),
                keep,
                result["errors"],
            )
            for batching, ways in plan
        ]
        run_servers(servers, args.interleave_servers, save)

    if args.peer is not None:
        result["peer"] = []
        seq = args.scale_to or measured["max_seq"]
        for conc in concs:
            p = run_peer(
                args.peer, args.trace, seq, work, conc, measured["tokens_needed_plus"], args
            )
            result["peer"].append(p)
            if "error" in p:
                result["errors"].append(f"peer × {conc}: {p['error'][:300]}")
            log(f"peer × {conc}: {p.get('result', p.get('error'))}")
            save()

    print_table(result)
    save()
    differing = sum(mismatches.values())
    if alone is None:
        print("answers not compared with the prompt alone (--skip-alone or --ways none)")
    else:
        print(f"answers differing from the prompt alone: {differing} (every way, every round)")
    if result["errors"]:
        sys.exit("error: " + "\n".join(result["errors"][:8]))
    if differing and not args.tolerate_mismatch:
        sys.exit(f"error: answers that differ from the prompt alone: {differing}")


if __name__ == "__main__":
    main()
