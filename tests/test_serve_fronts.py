"""``serve --http-workers N`` (``pipeline.server.fronts``): several HTTP processes in front of
the one engine answer as one does, share one queue bound and one set of metrics, drain
together on the server's SIGTERM, and a front that dies stops the server as a dead engine
does; the engine's side routes each front's events back to it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import types
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

from pipeline.contracts.bucket import Bucket
from pipeline.server.engine_main import route
from pipeline.server.engine_process import EngineProcess
from pipeline.server.jobs import QueueFull, Request
from pipeline.server.metrics import Metrics
from tests.serve_helpers import REPO, ServerProcess, get, metric
from tests.test_serve_process import MODEL, STEP_DELAY_S, children, gone, together, wait_until

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

_SERVE = (sys.executable, "-c", "from pipeline.cli import main; main()", "serve")
PROMPTS = [([1, 2, 3], 6), ([7], 9), ([4, 4, 4, 4, 4], 3), ([9, 8], 12), ([5, 6], 7), ([3], 4)]


@pytest.fixture(scope="module")
def release(installed):
    return installed[1]


def test_route_sends_each_front_its_own_events_and_front_0_the_engines_records():
    items = [(1, 11), (2, 12), (3, 13), (4, "stop"), (6, 16)]
    records = [("admitted", 5, 0.01), ("step", "b1_s32", 1), ("admitted", 3, 0.0), ("ttft", 0.1)]
    out = route(3, items, records)
    assert out == {
        0: ([(1, 11), (4, "stop")], [("step", "b1_s32", 1), ("ttft", 0.1)]),
        1: ([(2, 12)], [("admitted", 5, 0.01)]),
        2: ([(3, 13), (6, 16)], [("admitted", 3, 0.0)]),
    }
    assert route(3, [], []) == {}
    assert route(1, items, records) == {0: (items, records)}
    assert route(1, [], []) == {}


class _Conn:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)


def test_fronts_number_their_requests_apart_and_share_one_queue_bound():
    """Front i numbers i+1, i+1+N, ...; --max-queue counts what waits in every front, and
    an admission in one frees a place for all."""
    import multiprocessing

    queued = multiprocessing.get_context("fork").Array("i", 2, lock=False)
    loaded = types.SimpleNamespace(largest=Bucket(batch=2, seq=64))
    fronts = [EngineProcess(None, _Conn(), 3, None, queued, front=i, fronts=2) for i in range(2)]
    for f in fronts:
        f.loaded, f.metrics = loaded, Metrics()
    a, b = fronts
    reqs = [Request([1], 2, 3, None) for _ in range(4)]
    a.submit(reqs[0])
    b.submit(reqs[1])
    a.submit(reqs[2])
    assert [r.rid for r in reqs[:3]] == [1, 2, 3] and a.depth == b.depth == 3
    with pytest.raises(QueueFull):
        b.submit(reqs[3])
    b._records([("admitted", 2, 0.0)])  # front 1's own request leaves the queue
    assert a.depth == 2
    b.submit(reqs[3])
    assert reqs[3].rid == 4 and b.depth == 3
    a.cancel(reqs[0])
    a._events([(3, "stop")])  # ends while waiting (cancelled by the engine, say)
    assert b.depth == 1
    assert [m[1] for m in b.conn.sent if m[0] == "submit"] == [2, 4]


def _no_slot_busy(url: str):
    return lambda: metric(get(url + "/metrics")[1], "inf2_serve_slots", state="busy") == 0


def test_fronts_answer_as_one_front_does_and_sum_their_metrics(release, tmp_path):
    """The same prompts, sent together, get the same tokens from one front and from three;
    the server's children are the engine and two fronts; /metrics, whichever front answers
    it, counts every front's requests and tokens once, and the slots once. The engine's
    records (the slots freed) go to front 0 while a request's last event goes to its own
    front, so a scrape just after the answers may still see a slot busy: the scrapes wait
    until one sees none (CI, 2026-12-08: 5 free of 6)."""
    answers, scrapes = {}, {}
    for n in (1, 3):
        log = tmp_path / f"serve{n}.log"
        with ServerProcess(release, log, "--http-workers", str(n)) as s:
            s.wait_ready()
            answers[n] = together(s.url, PROMPTS)
            kids = children(s.proc.pid)
            wait_until(_no_slot_busy(s.url), 10.0, "a slot stayed busy after every answer")
            scrapes[n] = [get(s.url + "/metrics")[1] for _ in range(6)]
            assert s.stop() == 0
        assert len(kids) == n, s.output()
    assert answers[3] == answers[1]
    assert [len(a) for a in answers[3]] == [k for _, k in PROMPTS]
    assert f"{3} HTTP processes in front" in s.output()
    slots = metric(scrapes[1][0], "inf2_serve_slots", state="free")
    assert slots > 0
    for text in scrapes[1] + scrapes[3]:
        assert metric(text, "inf2_serve_requests_total", outcome="ok") == len(PROMPTS)
        assert metric(text, "inf2_serve_completion_tokens_total") == sum(k for _, k in PROMPTS)
        assert metric(text, "inf2_serve_time_to_first_token_seconds_count") == len(PROMPTS)
        assert metric(text, "inf2_serve_ready") == 1
        assert metric(text, "inf2_serve_slots", state="free") == slots
        assert metric(text, "inf2_serve_slots", state="busy") == 0


def connections(pid: int, port: int, state: str = "01") -> int:
    """TCP sockets on ``port`` that ``pid`` holds, in ``state`` (01: established, the
    clients a front accepted; 0A: listening)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == state and f[9] in inodes:
                    held += 1
    return held


def _stream(url: str, prompt: list[int], max_tokens: int) -> http.client.HTTPResponse:
    host = urlparse(url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=120)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    return response


def _tokens(text: str) -> int:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: {")]
    return sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events)


def _late_post(url: str, body: dict) -> tuple[int, dict]:
    """post, with a connection refused or reset before the status line as status 0: what a
    request meets when its connection waits in the backlog of a front that closes. A reset
    after the status line still raises: an answer begun is an answer owed whole."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        response = urllib.request.urlopen(request, timeout=120)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, ConnectionError):
        return 0, {}
    with response:
        return response.status, json.loads(response.read())


def test_the_servers_sigterm_drains_every_front(release, tmp_path):
    """Streams on several connections (the kernel spreads them over the fronts: at least two
    hold some), then SIGTERM to the server alone, as the kubelet sends it, and requests that
    keep coming: every stream ends whole, a late request is answered whole or refused with
    503 (never a 500, never left hanging) by whichever front it reached, or, reaching a front
    as it closes, is refused or reset before a byte of answer (status 0: it never ran, and a
    client retries it), the server exits 0, and neither the engine nor a front outlives it."""
    with ServerProcess(
        release, tmp_path / "serve.log", "--http-workers", "3", step_delay_s=STEP_DELAY_S
    ) as s:
        s.wait_ready()
        kids, port = children(s.proc.pid), urlparse(s.url).port
        streams = [_stream(s.url, [1 + i, 2], 30) for i in range(6)]
        pids = [s.proc.pid, *kids]
        held = [connections(pid, port) for pid in pids]
        if sum(n > 0 for n in held) < 2:
            # the front that woke first took them all (a loaded machine schedules one
            # first, again and again): stopped, it cannot accept, so another front does
            busy = pids[held.index(max(held))]
            os.kill(busy, signal.SIGSTOP)
            try:
                streams.append(_stream(s.url, [8, 2], 30))  # no EOS in 30 tokens
            finally:
                os.kill(busy, signal.SIGCONT)
            held = [connections(pid, port) for pid in pids]
        assert sum(n > 0 for n in held) >= 2, held
        for r in streams:
            assert r.readline().startswith(b"data: ")  # each runs
        s.proc.send_signal(signal.SIGTERM)
        late: list[tuple[int, dict]] = []
        body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 5}
        senders = [
            threading.Thread(
                target=lambda: late.append(_late_post(s.url + "/v1/completions", body))
            )
            for _ in range(8)
        ]
        for t in senders:
            t.start()
        rests = [r.read().decode() for r in streams]
        for t in senders:
            t.join(120)
        assert s.proc.wait(60) == 0, s.output()
    for rest in rests:
        assert rest.rstrip().endswith("data: [DONE]") and _tokens(rest) == 29, rest
    assert len(late) == 8 and all(t.is_alive() is False for t in senders)
    for status, answer in late:
        assert status in (0, 200, 503), (status, answer)
        if status == 200:
            assert len(answer["choices"][0]["token_ids"]) == 5
    for kid in kids:
        wait_until(lambda kid=kid: gone(kid), 30, "a child outlived the server")


def test_a_sigterm_while_starting_ends_every_front_cleanly(release, tmp_path):
    """SIGTERM as soon as the server listens (the pod deleted while it starts: the fronts
    and the engine still loading): no front misses it, the server exits 0, nothing is
    left behind."""
    with ServerProcess(release, tmp_path / "serve.log", "--http-workers", "3") as s:
        s.wait_listening()
        kids = children(s.proc.pid)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(120) == 0, s.output()
    assert "Traceback" not in s.output()
    for kid in kids:
        wait_until(lambda kid=kid: gone(kid), 30, "a child outlived the server")


def test_a_dead_front_stops_the_server_and_fails_nothing_silently(release, tmp_path):
    """A front killed outright (the OOM killer, say): the server says which, in one line,
    exits 1, and takes the engine and the other fronts with it."""
    with ServerProcess(release, tmp_path / "serve.log", "--http-workers", "2") as s:
        s.wait_ready()
        kids, port = children(s.proc.pid), urlparse(s.url).port
        (front,) = [k for k in kids if connections(k, port, "0A")]  # the engine listens not
        os.kill(front, signal.SIGKILL)
        assert s.proc.wait(60) == 1, s.output()
        out = s.output()
    assert f"(pid {front}) was killed by signal 9" in out, out
    assert "Traceback" not in out
    for kid in kids:
        wait_until(lambda kid=kid: gone(kid), 30, "a child outlived the server")


def test_http_workers_need_the_engines_process_in_one_line(release):
    r = subprocess.run(
        [*_SERVE, str(release), "--port", "0", "--http-workers", "2", "--no-engine-process"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert (
        r.returncode == 2
        and r.stderr.startswith("error: --http-workers 2: ")
        and (len(r.stderr.strip().splitlines()) == 1)
    ), r.stderr


@pytest.mark.parametrize(
    ("backend", "engine_process", "cpus", "fronts"),
    [
        ("cuda", True, 1, 1),
        ("cuda", True, 2, 1),
        ("cuda", True, 3.5, 1),
        ("neuron", True, 4, 2),
        ("cuda", True, 7, 3),
        ("cuda", True, 16, 4),
        ("neuron", True, 192, 4),
        ("cpu", True, 16, 1),  # the model's own threads want the cores
        ("cuda", False, 16, 1),  # fronts need the engine's own process
    ],
)
def test_auto_http_workers_one_per_two_cpus_up_to_four(backend, engine_process, cpus, fronts):
    from pipeline.server.fronts import auto_count

    assert auto_count(backend, engine_process, cpus) == fronts


def test_usable_cpus_are_capped_by_a_pods_cgroup_quota(tmp_path):
    from pipeline._cpus import usable_cpus

    mine = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == mine  # no cgroup files: affinity alone
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == mine  # v2, no limit
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # limits.cpu: 500m
    assert usable_cpus(tmp_path) == min(mine, 0.5)
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1, no limit
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == mine
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("25000\n")
    assert usable_cpus(tmp_path) == min(mine, 0.25)


def test_the_default_on_the_cpu_backend_is_one_front(release, tmp_path):
    """``--http-workers auto`` (the default) on a cpu release: one HTTP process, as before
    the default was auto (the ready line names more than one only when there are)."""
    with ServerProcess(release, tmp_path / "serve.log") as s:
        s.wait_ready(120)
        ready = [ln for ln in s.output().splitlines() if ln.startswith("ready:")]
    assert ready and "HTTP processes in front" not in ready[0]
