"""``inf2-pipeline serve`` as a real process on 127.0.0.1, driven by real HTTP clients (the
official ``openai`` client, urllib and http.client), on the compiled demo release (cpu, fp32;
buckets b1/b2 × s32/s64)."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from tests.serve_helpers import REPO, ServerProcess, get, metric, post

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def release(installed):
    return installed[1]


@pytest.fixture(scope="module")
def server(release, tmp_path_factory):
    """One server for the module, as `serve` runs by default."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServerProcess(release, log) as s:
        s.wait_ready()
        yield s


STEP_DELAY_S = 0.03  # the slow server's pause before every decode step


@pytest.fixture(scope="module")
def slow_server(release, tmp_path_factory):
    """A server whose every decode step takes 30 ms more: requests run long enough for a
    test to join, read and leave while they provably run, on any machine."""
    log = tmp_path_factory.mktemp("serve-slow") / "serve.log"
    with ServerProcess(release, log, step_delay_s=STEP_DELAY_S) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def reference(release):
    """The model in this process: what each prompt gives when generated alone."""
    from pipeline.runtime import BucketedModel

    model = BucketedModel.load(release)

    def alone(prompt: list[int], max_tokens: int) -> list[int]:
        return model.generate([prompt], max_tokens)[0]

    alone.model = model  # type: ignore[attr-defined]
    return alone


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert get(server.url + "/health")[0] == 200
    status, body = get(server.url + "/ready")
    assert status == 200 and json.loads(body)["status"] == "ready"


def test_completion_with_token_ids_and_text(client, reference, release):
    from transformers import AutoTokenizer

    prompt = [1, 17, 42, 99, 5]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert ids(choice) == reference(prompt, 12)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == len(ids(choice))
    assert choice.finish_reason in ("length", "stop")

    tok = AutoTokenizer.from_pretrained(release / "current")
    text = "The server batches waiting requests"
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=10)
    choice = r.choices[0]
    assert ids(choice) == reference(tok(text).input_ids, 10)
    assert choice.text == tok.decode(ids(choice), skip_special_tokens=True)
    assert choice.text  # the demo tokenizer covers the whole vocabulary


def test_streaming_equals_the_whole_answer(client):
    prompt = "Greedy decoding picks the most likely"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True))
    # (a model faster than the front: what piled up comes in one event; at a device's pace,
    # token by token: test_a_stream_comes_token_by_token)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [t for c in chunks for t in ids(c.choices[0])] == ids(whole.choices[0])
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_stream_comes_token_by_token(slow_server):
    """At a device's pace a stream comes as its tokens do, not in one burst at the end: one
    event each while the loop keeps up (what piles up on a busy machine goes out together,
    serve's default; one event per token, always, is unit-tested with --no-coalesce)."""
    c = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="unused", max_retries=0)
    got = []  # (when, tokens) of each chunk that carries tokens
    for ch in c.completions.create(model=MODEL, prompt=[1, 17, 42], max_tokens=8, stream=True):
        if ids(ch.choices[0]):
            got.append((time.monotonic(), len(ids(ch.choices[0]))))
    assert sum(n for _, n in got) == 8 and len(got) >= 3
    # 7 steps of 30 ms or more between the first token and the last
    assert got[-1][0] - got[0][0] >= 3 * STEP_DELAY_S


@pytest.mark.parametrize("flags, coalesce", [((), True), (("--no-coalesce",), False)])
def test_serve_coalesces_by_default(release, monkeypatch, flags, coalesce):
    """The CLI's default is the library's: tokens that piled up go out together;
    --no-coalesce reaches the server as one event per token."""
    from typer.testing import CliRunner

    import pipeline.server.launch as launch
    from pipeline.cli import app
    from pipeline.server.loading import ServeOptions

    got = []
    monkeypatch.setattr(launch, "serve", got.append)  # the options, not a server
    r = CliRunner().invoke(app, ["serve", str(release), *flags])
    assert r.exit_code == 0, r.output
    assert got[0].coalesce is coalesce
    assert ServeOptions(release).coalesce is True


def test_stream_usage_option(server):
    from openai import OpenAI

    c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=[1, 5, 9],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens == 3
    assert chunks[-1].usage.completion_tokens == sum(len(ids(c.choices[0])) for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, stream):
    prompt = "A compiled graph serves every request"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24).choices[0].text
    assert len(full) > 12, full
    stop = full[6:9]  # a piece from the middle of the answer
    cut = full[: full.index(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop, "\x00never"])
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kw).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert text == cut and stop not in text
    assert reason == "stop"


def test_concurrent_requests_answers_unchanged(server, reference):
    """Requests sent together, of mixed lengths, each prefilled into a slot of its own: each
    answer is exactly what the model gives for that prompt alone (fp32 on cpu)."""
    before = get(server.url + "/metrics")[1]
    cases = [
        ([1 + (7 * i) % 300 for _ in range(1 + i % 5)] + [3 + i], 4 + 3 * (i % 6))
        for i in range(10)
    ]
    host = urlparse(server.url)
    conns = [http.client.HTTPConnection(host.hostname, host.port, timeout=120) for _ in cases]
    for c in conns:
        c.connect()
    for c, (prompt, n) in zip(conns, cases, strict=True):  # all sent before any answer
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n}
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    for c, (prompt, n) in zip(conns, cases, strict=True):
        r = c.getresponse()
        assert r.status == 200
        got = json.loads(r.read())["choices"][0]["token_ids"]
        assert got == reference(prompt, n), (prompt, n)
        c.close()
    after = get(server.url + "/metrics")[1]
    assert metric(after, "inf2_serve_prefills_total") - metric(
        before, "inf2_serve_prefills_total"
    ) == len(cases)
    assert metric(after, "inf2_serve_slots", state="busy") == 0


def test_too_long_and_unsupported_parameters_are_400(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=list(range(1, 61)), max_tokens=10)
    assert "b2_s64" in str(e.value) and "69" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4, temperature=-0.7)
    assert "temperature" in str(e.value)
    for extra in ({"top_p": 1.5}, {"n": 2}, {"logprobs": 3}, {"top_k": -5}, {"echo": True}):
        status, body, _ = post(
            server.url + "/v1/completions",
            {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, **extra},
        )
        assert status == 400, (extra, body)
        assert next(iter(extra)) in body["error"]["message"]
    status, body, _ = post(server.url + "/v1/completions", {"model": MODEL, "prompt": [1, 9999]})
    assert status == 400 and "vocabulary" in body["error"]["message"]
    # JSON true is not token 1 nor a max_tokens of 1; "yes" is not a bool.
    for bad in ({"prompt": [True, 2]}, {"max_tokens": True}, {"stream": "yes"}):
        status, body, _ = post(
            server.url + "/v1/completions", {"model": MODEL, "prompt": [1, 2], **bad}
        )
        assert status == 400 and next(iter(bad)) in body["error"]["param"], (bad, body)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=[1, 2], max_tokens=2)


def test_metrics_counters_move(server, client):
    """One request of 4 prompt tokens and 5 answer tokens, alone: it goes to b1_s32 (the
    least padding, the smallest idle batch), one prefill of the 32-token graph, 4 steps."""
    before = get(server.url + "/metrics")[1]
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=5)
    after = get(server.url + "/metrics")[1]

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert r.usage.completion_tokens == 5
    assert delta("inf2_serve_requests_total", outcome="ok") == 1
    assert delta("inf2_serve_prompt_tokens_total") == 4
    assert delta("inf2_serve_completion_tokens_total") == 5
    assert delta("inf2_serve_prefills_total", bucket="b1_s32") == 1
    assert delta("inf2_serve_steps_total", bucket="b1_s32") == 4
    positions = "inf2_serve_positions_total"
    assert delta(positions, bucket="b1_s32", phase="prefill", kind="real") == 4
    assert delta(positions, bucket="b1_s32", phase="prefill", kind="padding") == 28
    assert delta(positions, bucket="b1_s32", phase="decode", kind="real") == 4
    assert delta(positions, bucket="b1_s32", phase="decode", kind="padding") == 0
    for h in ("time_to_first_token", "queue_time", "request_duration", "admission"):
        assert delta(f"inf2_serve_{h}_seconds_count") == 1, h
    assert delta("inf2_serve_time_to_first_token_written_seconds_count") == 0  # not streamed
    assert delta("inf2_serve_inter_token_latency_seconds_count") == 4
    ttft = delta("inf2_serve_time_to_first_token_seconds_sum")
    assert 0 < ttft < delta("inf2_serve_request_duration_seconds_sum")
    assert delta("inf2_serve_admission_seconds_sum") > 0
    assert metric(after, "inf2_serve_slots", bucket="b2_s64", state="free") == 2
    assert metric(after, "inf2_serve_queue_depth") == 0
    assert metric(after, "inf2_serve_ready") == 1

    # streamed: the first token's write is timed too, after the engine had the token
    stream = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, stream=True)
    assert sum(len(ids(ch.choices[0])) for ch in stream) == 3
    streamed = get(server.url + "/metrics")[1]

    def since(name: str) -> float:
        return metric(streamed, name) - metric(after, name)

    assert since("inf2_serve_time_to_first_token_written_seconds_count") == 1
    written = since("inf2_serve_time_to_first_token_written_seconds_sum")
    assert since("inf2_serve_time_to_first_token_seconds_sum") < written
    assert written < since("inf2_serve_request_duration_seconds_sum")
    # the front's event loop is probed all along (every 10 ms), whatever it serves
    assert metric(streamed, "inf2_serve_event_loop_lag_seconds_count") > 0


def test_start_up_is_timed_by_phase(server):
    """The ready line and ``inf2_serve_startup_seconds`` say where a start's time went: the
    release loaded, warmed, the engine made, the tokenizer (loaded beside them), in all."""
    text = get(server.url + "/metrics")[1]
    took = {
        p: metric(text, "inf2_serve_startup_seconds", phase=p)
        for p in ("load", "warm", "engine", "tokenizer", "total")
    }
    assert all(took[p] > 0 for p in ("load", "warm", "tokenizer")), took
    assert took["total"] >= took["load"] + took["warm"] + took["engine"], took
    line = re.search(r"ready: .* in ([\d.]+) s \(load [\d.]+, warm [\d.]+, engine [\d.]+; "
                     r"tokenizer [\d.]+\)", server.log.read_text())  # fmt: skip
    assert line and float(line[1]) == pytest.approx(took["total"], abs=0.06)


def test_the_tokenizer_loaded_early_is_the_engine_releases_or_loaded_again(
    release, tmp_path, monkeypatch
):
    """The front loads the tokenizer while the engine loads the release, from the release
    it finds where ``serve`` points. It is used where the engine loaded that one (what
    loading it raised is raised then); where ``current`` moved in between, or nothing was
    found early, the tokenizer of the release the engine loaded is loaded then."""
    from pipeline.install.installed import find_release
    from pipeline.server import service as service_module
    from pipeline.server.loading import Loaded, ServeOptions

    loads = []

    def load(d):
        loads.append(d)
        if d.name == "broken":
            raise ValueError("no tokenizer")
        return f"tokenizer of {d.name}"

    monkeypatch.setattr(service_module, "load_tokenizer", load)
    found = find_release(release)

    def loaded(d):
        return Loaded("m", "v", "cpu", d, 8, (), True, 0, 0)

    early = service_module.Service(ServeOptions(path=release))._early_tokenizer()
    assert early[:2] == (found, f"tokenizer of {found.name}") and loads == [found]
    got = loaded(found)
    assert service_module.Service._tokenizer(got, early) == early[1] and len(loads) == 1
    assert got.startup["tokenizer"] == early[2]
    moved = tmp_path / "20990101-newer"
    assert service_module.Service._tokenizer(loaded(moved), early) == "tokenizer of " + moved.name
    assert service_module.Service._tokenizer(loaded(moved), None) == "tokenizer of " + moved.name
    assert loads == [found, moved, moved]
    broken = (tmp_path / "broken", ValueError("no tokenizer"), 0.1)
    with pytest.raises(ValueError, match="no tokenizer"):
        service_module.Service._tokenizer(loaded(tmp_path / "broken"), broken)
    assert service_module.Service(ServeOptions(path=tmp_path))._early_tokenizer() is None


def _wait_for_one_disconnect(server, before: str) -> str:
    """Poll /metrics (60 s at most) until one more request counts as disconnected and none
    is in flight; the metrics text then."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = get(server.url + "/metrics")[1]
        gone = metric(now, "inf2_serve_requests_total", outcome="disconnected") - metric(
            before, "inf2_serve_requests_total", outcome="disconnected"
        )
        if gone == 1 and metric(now, "inf2_serve_in_flight") == 0:
            return now
        time.sleep(0.05)
    pytest.fail(f"the disconnect was not seen:\n{now}")


def _busy(server) -> float:
    return metric(get(server.url + "/metrics")[1], "inf2_serve_slots", state="busy")


def _until(what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_client_disconnect_frees_its_slot(slow_server, client):
    """A whole-answer client that leaves while its 60 tokens run (1.8 s of steps at least):
    the request is counted as disconnected and its slot is free long before it would have
    ended; the server goes on answering."""
    before = get(slow_server.url + "/metrics")[1]
    host = urlparse(slow_server.url)
    body = json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 60}).encode()
    with socket.create_connection((host.hostname, host.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        _until(lambda: _busy(slow_server) == 1)
    start = time.monotonic()
    now = _wait_for_one_disconnect(slow_server, before)
    _until(lambda: _busy(slow_server) == 0)
    assert time.monotonic() - start < 60 * STEP_DELAY_S  # freed, not run to its end
    assert metric(now, "inf2_serve_queue_depth") == 0
    assert client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3).choices


def test_streaming_client_that_leaves_frees_its_slot_for_the_next(slow_server, reference):
    """A streaming client that leaves after its first tokens (60 to go): its slot is freed
    within an iteration and a new request takes it; the next answer is still exact."""
    slow = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="unused", max_retries=0)
    before = get(slow_server.url + "/metrics")[1]
    stream = slow.completions.create(model=MODEL, prompt=[1, 2], max_tokens=60, stream=True)
    got = [next(iter(stream)) for _ in range(2)]
    assert all(c.choices for c in got)
    stream.close()
    _wait_for_one_disconnect(slow_server, before)
    _until(lambda: _busy(slow_server) == 0)
    r = slow.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6)
    assert ids(r.choices[0]) == reference([5, 6, 7], 6)


def test_a_short_request_finishes_while_a_long_one_streams(slow_server, reference):
    """No head-of-line blocking: a 2-token request sent while a 50-token answer streams
    (in the same bucket length) is answered before the long one ends, and both are exact."""
    slow = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="unused", max_retries=0)
    long_prompt = [9, 8, 7, 6]
    stream = slow.completions.create(model=MODEL, prompt=long_prompt, max_tokens=50, stream=True)
    chunks = iter(stream)
    tokens = list(ids(next(chunks).choices[0]))  # the long one runs
    short = slow.completions.create(model=MODEL, prompt=[3, 4], max_tokens=2)
    short_done = time.monotonic()
    assert ids(short.choices[0]) == reference([3, 4], 2)
    for c in chunks:
        if c.choices:
            tokens += ids(c.choices[0])
    long_done = time.monotonic()
    assert tokens == reference(long_prompt, 50)
    assert long_done - short_done > 10 * STEP_DELAY_S  # the long one had many steps to go


def test_staggered_mixed_requests_with_leavers_each_equal_alone(slow_server, reference):
    """Requests of mixed lengths arrive while others run, finish at different steps, and
    some clients leave mid-stream: every answer that is read equals its prompt alone."""
    host = urlparse(slow_server.url)
    cases = [([11 + i, 3, 5 + 2 * i][: 1 + i % 3], 3 + 5 * (i % 4)) for i in range(8)]
    leavers = {2, 5}

    def run(i: int) -> list[int] | None:
        time.sleep(0.05 * i)  # staggered: each arrives while earlier ones run
        prompt, n = cases[i]
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=120)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        assert r.status == 200
        got: list[int] = []
        for line in r:
            if i in leavers and got:
                conn.close()  # leaves after its first tokens
                return None
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:])["choices"]
                got += choices[0]["token_ids"] if choices else []
        conn.close()
        return got

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(run, range(len(cases))))
    for i, (prompt, n) in enumerate(cases):
        if i not in leavers:
            assert answers[i] == reference(prompt, n), (i, prompt, n)
    _until(lambda: _busy(slow_server) == 0)


def test_lifecycle_readiness_full_queue_and_sigterm_drain(release, reference, tmp_path):
    """A fresh slow server with one queue place: /health before /ready; with every slot
    of the s64 buckets taken, a burst gets 503 + Retry-After for all but the one queued
    request; SIGTERM refuses new connections, finishes the running and the queued
    requests to their full answers, and exits 0."""
    with ServerProcess(
        release, tmp_path / "serve.log", "--max-queue", "1", step_delay_s=STEP_DELAY_S
    ) as s:
        url = s.wait_listening()
        deadline = time.monotonic() + 120
        while get(url + "/health")[0] != 200:
            assert time.monotonic() < deadline, s.output()
            time.sleep(0.02)
        status, body = get(url + "/ready")
        assert status == 503 and json.loads(body)["status"] in ("loading", "warming up")
        status, body, headers = post(url + "/v1/completions", {"model": MODEL, "prompt": [1]})
        assert status == 503 and headers.get("Retry-After")
        s.wait_ready()

        # need 3 + 40 - 1 = 42 positions: only the s64 buckets hold it, 3 slots in all
        host = urlparse(url)
        prompts = [[1, 40 + i, 7] for i in range(7)]

        def send(p: list[int]) -> http.client.HTTPConnection:
            c = http.client.HTTPConnection(host.hostname, host.port, timeout=120)
            body = json.dumps({"model": MODEL, "prompt": p, "max_tokens": 40})
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            return c

        running = []
        for p in prompts[:3]:
            running.append(send(p))
            n = len(running)
            _until(
                lambda n=n: metric(get(url + "/metrics")[1], "inf2_serve_slots", state="busy") == n
            )
        burst = [send(p) for p in prompts[3:]]

        def answer(c: http.client.HTTPConnection) -> tuple[int, str | None, dict]:
            r = c.getresponse()
            return r.status, r.getheader("Retry-After"), json.loads(r.read())

        with ThreadPoolExecutor(7) as pool:
            futures = [pool.submit(answer, c) for c in running + burst]
            late = futures[3:]
            _until(lambda: sum(f.done() for f in late) == 3)  # the 503s come at once
            (queued,) = [i for i, f in enumerate(late) if not f.done()]
            rejected = [f.result() for f in late if f.done()]
            assert [r[0] for r in rejected] == [503] * 3
            assert all(r[1] for r in rejected)
            assert "queue is full" in rejected[0][2]["error"]["message"]

            s.terminate()
            deadline = time.monotonic() + 60
            while True:  # stops accepting
                try:
                    socket.create_connection((host.hostname, host.port), timeout=1).close()
                except OSError:
                    break
                assert time.monotonic() < deadline, "still accepting after SIGTERM"
                time.sleep(0.02)
            results = [f.result(timeout=120) for f in futures[:3]] + [late[queued].result(120)]
        order = [*prompts[:3], prompts[3 + queued]]
        for (status, _, body), p in zip(results, order, strict=True):
            assert status == 200
            assert body["choices"][0]["token_ids"] == reference(p, 40)
        assert s.stop(timeout=60) == 0, s.output()


def test_serve_refuses_a_missing_release_in_one_line(tmp_path):
    import subprocess
    import sys

    from tests.serve_helpers import REPO

    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pipeline.cli import main; main()",
            "serve",
            str(tmp_path / "nope"),
        ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


_SERVE_CMD = (sys.executable, "-c", "from pipeline.cli import main; main()", "serve")


def test_serve_refuses_an_empty_api_key_in_one_line(release):
    r = subprocess.run(
        [*_SERVE_CMD, str(release), "--port", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "INF2_SERVE_API_KEY": " ", "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert "INF2_SERVE_API_KEY" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_serve_refuses_a_taken_port_in_one_line(release):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [*_SERVE_CMD, str(release), "--port", str(port)],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            timeout=120,
        )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen: in use")
    assert len(r.stderr.strip().splitlines()) == 1


class _Tokenized:
    def __init__(self, ids: list[int]) -> None:
        self.input_ids = ids


def _service_with_tokenizer(ids: list[int], *, vocab: int = 100, max_seq: int = 32):
    from types import SimpleNamespace

    from pipeline.contracts.bucket import Bucket

    calls: list[str] = []

    def tokenizer(text: str) -> _Tokenized:
        calls.append(text)
        return _Tokenized(ids)

    engine = SimpleNamespace(largest=Bucket(1, max_seq))
    return SimpleNamespace(tokenizer=tokenizer, vocab=vocab, engine=engine), calls


def test_tokenizer_ids_outside_the_vocabulary_are_a_400_not_a_crash():
    """A tokenizer with added tokens beyond the model's embedding: its ids must be refused
    like a client's, or the device would index past the embedding."""
    import asyncio

    from pipeline.server.admission import token_ids
    from pipeline.server.protocol import ApiError, parse_request

    engine, _ = _service_with_tokenizer([5, 100, 7])
    req = parse_request({"model": MODEL, "prompt": "hello"})
    with pytest.raises(ApiError, match=r"the tokenizer gave token ids \[100\]") as e:
        asyncio.run(token_ids(engine, "hello", req))
    assert e.value.status == 400
    engine, _ = _service_with_tokenizer([5, 99, 7])
    assert asyncio.run(token_ids(engine, "hello", req)) == [5, 99, 7]


def test_a_prompt_too_long_for_any_bucket_is_refused_before_tokenizing():
    import asyncio

    from pipeline.server.admission import MAX_CHARS_PER_POSITION, token_ids
    from pipeline.server.protocol import ApiError, parse_request

    engine, calls = _service_with_tokenizer([1])
    text = "x" * (32 * MAX_CHARS_PER_POSITION + 1)
    req = parse_request({"model": MODEL, "prompt": text})
    with pytest.raises(ApiError, match="cannot fit the largest bucket") as e:
        asyncio.run(token_ids(engine, text, req))
    assert e.value.code == "context_length_exceeded" and calls == []


def test_warm_up_runs_only_the_buckets_a_budgeted_runner_kept_loaded(release):
    """neuron keeps what fits its HBM budget: warming every bucket would load (and evict)
    them all before the first request."""
    from pipeline.runtime import BucketedModel

    model = BucketedModel.load(release)
    assert model.warm_buckets() == model.buckets  # cpu: every bucket stays loaded
    model.runner.loaded = model.buckets[:1]
    assert model.warm_buckets() == model.buckets[:1]


def test_batched_rows_equal_single_rows_on_cpu(reference):
    """The claim under the server: a prompt's tokens in a shared batch of the largest bucket
    equal its tokens alone in its smallest bucket (fp32 on cpu)."""
    model = reference.model
    from pipeline.contracts.bucket import Bucket

    cases = [([1, 17, 42, 99, 5], 12), ([3, 3, 3], 20), ([200, 100, 50, 25, 12, 6, 3, 1], 9)]
    for (p, n), (q, m) in zip(cases, cases[1:] + cases[:1], strict=True):
        both = model.session(Bucket(2, 64)).generate([p, q], max(n, m), model.eos_token_id)
        assert both[0][:n] == reference(p, n)
        assert both[1][:m] == reference(q, m)


def test_session_on_tokens_streams_each_step_and_can_stop(reference):
    """The runtime hook under streaming: one call per step with each row's token, equal to
    the result; True stops the loop there."""
    from pipeline.contracts.bucket import Bucket

    session = reference.model.session(Bucket(2, 64))
    prompts = [[1, 17, 42], [5, 6, 7, 8]]
    steps: list[list[int]] = []
    rows = session.generate(prompts, 10, None, on_tokens=lambda t: steps.append(t))
    assert [[s[i] for s in steps] for i in range(2)] == rows
    assert rows == session.generate(prompts, 10, None)  # the plain loop gives the same
    calls: list[list[int]] = []
    short = session.generate(
        prompts, 10, None, on_tokens=lambda t: calls.append(t) or len(calls) == 3
    )
    assert len(calls) == 3 and short == [r[:3] for r in rows]


def test_listen_binds_like_uvicorn_and_names_the_host():
    """IPv4 unless the host has ':' (so localhost is 127.0.0.1 even where it is also ::1);
    an address not of this machine names --host, not --port."""
    from pipeline.errors import InputError
    from pipeline.server.launch import _listen

    with _listen("localhost", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    with pytest.raises(InputError, match=r"^--host 192\.0\.2\.1: cannot listen there"):
        _listen("192.0.2.1", 0)  # TEST-NET-1: never this machine's
