"""bench_serve.py's open loop (``--rate``): requests go out when they are due, not when a
client frees, and their TTFT counts from when they were due. Against a stub SSE server that
answers one token after a fixed delay, so what is checked is the client's clock, not a model.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_serve

DELAY = 0.2  # the stub's time to first token: long beside a loaded machine's hiccups


class _Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    sent: ClassVar[list[float]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        _Stub.sent.append(time.perf_counter())
        time.sleep(DELAY)
        chunk = json.dumps({"choices": [{"token_ids": [7]}]})
        body = f"data: {chunk}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub_url():
    _Stub.sent = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_poisson_arrivals_start_at_zero_rise_and_keep_their_rate():
    due = bench_serve.poisson_arrivals(4000, rate=50.0, seed=3)
    assert due[0] == 0.0 and all(b > a for a, b in itertools.pairwise(due))
    assert due == bench_serve.poisson_arrivals(4000, rate=50.0, seed=3)  # seeded
    assert 4000 / due[-1] == pytest.approx(50.0, rel=0.1)


def test_open_loop_sends_each_request_when_due_and_counts_ttft_from_then(stub_url):
    work = [([1, 2, 3], 1)] * 4
    due = [0.0, 0.3, 0.6, 0.9]  # a client is free for each: 4 clients
    before = time.perf_counter()
    wall, answers, errors = bench_serve.replay(stub_url, "m", work, 4, 10.0, arrivals=due)
    assert not errors and all(a is not None and a.ids == [7] for a in answers)
    # none went out before it was due (lower bounds only: a loaded machine may be late)
    assert all(t >= before + d for t, d in zip(sorted(_Stub.sent), due, strict=True))
    assert wall >= 0.9 + DELAY
    assert all(a.ttft >= DELAY for a in answers)


def test_open_loop_with_too_few_clients_shows_the_wait_in_ttft(stub_url):
    """All four due at once, one client: the last waits for three answers before it is sent,
    and that wait is in its TTFT (from when it was due), not hidden as if it had just come."""
    work = [([1], 1)] * 4
    _, answers, errors = bench_serve.replay(stub_url, "m", work, 1, 10.0, arrivals=[0.0] * 4)
    assert not errors
    assert answers[3].ttft >= 4 * DELAY
    # closed loop, one client: each request's clock starts when it is sent
    _, closed, _ = bench_serve.replay(stub_url, "m", work, 1, 10.0)
    assert closed[3].ttft < answers[3].ttft - 2 * DELAY


def test_client_processes_send_every_request_once_and_keep_the_clock(stub_url):
    """Threads spread over forked processes: each request sent exactly once (the stub runs
    in this process and sees them all), answers in request order, the open loop's due times
    kept on the clock every process shares."""
    work = [([1, i], 1) for i in range(6)]
    due = [0.0, 0.0, 0.3, 0.3, 0.6, 0.6]
    before = time.perf_counter()
    wall, answers, errors = bench_serve.replay(stub_url, "m", work, 4, 10.0, arrivals=due, procs=2)
    assert not errors and len(_Stub.sent) == 6
    assert all(a is not None and a.ids == [7] and a.ttft >= DELAY for a in answers)
    assert all(t >= before + d for t, d in zip(sorted(_Stub.sent), due, strict=True))
    assert wall >= 0.6 + DELAY


def test_client_processes_run_on_the_cpus_given_and_report_what_they_used(stub_url):
    """``--client-cpus``: the clients' CPU seconds come back summed over the processes."""
    cpu = min(os.sched_getaffinity(0))
    usage: dict[str, float] = {}
    work = [([1, i], 1) for i in range(4)]
    _, answers, errors = bench_serve.replay(
        stub_url, "m", work, 2, 10.0, procs=2, cpus={cpu}, usage=usage
    )
    assert not errors and all(a is not None for a in answers)
    assert usage["cpu_s"] > 0 and usage["involuntary"] >= 0


def test_each_client_process_is_pinned_before_it_sends():
    """Each client process runs on the CPUs given, read by the sender in that process (a
    stand-in for ``_clients`` that answers every request it takes with its own affinity)."""
    cpu = min(os.sched_getaffinity(0))

    def send(threads_n, start, take):
        raw = {}
        while (i := take()) is not None:
            raw[i] = (start, [(start, repr(sorted(os.sched_getaffinity(0))).encode())], start)
        return raw, []

    _, raw, errors, usage = bench_serve._client_procs(send, 6, 2, 2, 10.0, {cpu})
    assert not errors and sorted(raw) == list(range(6))
    assert {events[0][1] for _, events, _ in raw.values()} == {repr([cpu]).encode()}
    assert set(usage) == {"cpu_s", "involuntary"}


def test_client_processes_wait_for_thousands_of_requests():
    """4,000 requests at a 600 s request timeout: one wait of their product overflowed
    poll(2)'s milliseconds (OverflowError on a device, 2026-12-07)."""

    def send(threads_n, start, take):
        raw = {}
        while (i := take()) is not None:
            raw[i] = (start, [(start, b"x")], start)
        return raw, []

    _, raw, errors, _ = bench_serve._client_procs(send, 4000, 2, 2, 600.0)
    assert not errors and sorted(raw) == list(range(4000))


def test_a_client_process_that_dies_without_answers_fails_the_replay_at_once():
    def send(threads_n, start, take):
        os._exit(3)  # gone before it reports

    t = time.monotonic()
    with pytest.raises(RuntimeError, match="ended without its answers"):
        bench_serve._client_procs(send, 10, 2, 2, 600.0)
    assert time.monotonic() - t < 60  # not the 6,000 s its requests' timeouts would allow


@pytest.mark.parametrize(
    ("spec", "cpus"), [("0", {0}), ("0-1", {0, 1}), ("1,0", {0, 1}), ("0,0-0", {0})]
)
def test_cpu_lists_read_as_taskset_writes_them(spec, cpus):
    if not cpus <= os.sched_getaffinity(0):
        pytest.skip("this machine may not use those CPUs")
    assert bench_serve.cpu_list(spec) == cpus


@pytest.mark.parametrize("spec", ["", "a-b", "0-", "99999"])
def test_a_cpu_list_that_is_not_one_or_not_ours_is_refused(spec):
    with pytest.raises(argparse.ArgumentTypeError):
        bench_serve.cpu_list(spec)
