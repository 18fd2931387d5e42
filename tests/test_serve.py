"""``inf2-pipeline serve`` as a real process on 127.0.0.1, driven by real HTTP clients (the
official ``openai`` client, urllib and http.client), on the compiled demo release (cpu, fp32;
buckets b1/b2 × s32/s64)."""

from __future__ import annotations

import http.client
import json
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
    """One server for the module: 50 ms of batching wait, so concurrent requests share a
    batch."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServerProcess(release, log, "--max-wait-ms", "50") as s:
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
    assert len(chunks) > 2  # token by token, not one burst
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [t for c in chunks for t in ids(c.choices[0])] == ids(whole.choices[0])
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


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


def test_concurrent_requests_are_batched_and_answers_unchanged(server, reference):
    """Requests sent together share batches (bucket b2_*), and each answer is exactly what
    the model gives for that prompt alone (fp32 on cpu)."""
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
    batched = sum(
        metric(after, "inf2_serve_batch_rows_total", bucket=b)
        - metric(before, "inf2_serve_batch_rows_total", bucket=b)
        for b in ("b2_s32", "b2_s64")
    )
    assert batched >= 2, after


def test_too_long_and_unsupported_parameters_are_400(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=list(range(1, 61)), max_tokens=10)
    assert "b2_s64" in str(e.value) and "69" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4, temperature=0.7)
    assert "temperature" in str(e.value) and "greedily" in str(e.value)
    for extra in ({"top_p": 0.5}, {"n": 2}, {"logprobs": 3}, {"top_k": 5}):
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
    before = get(server.url + "/metrics")[1]
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=5)
    after = get(server.url + "/metrics")[1]

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("inf2_serve_requests_total", outcome="ok") == 1
    assert delta("inf2_serve_prompt_tokens_total") == 4
    assert delta("inf2_serve_completion_tokens_total") == r.usage.completion_tokens
    assert delta("inf2_serve_batches_total", bucket="b1_s32") >= 1
    real = delta("inf2_serve_bucket_tokens_total", bucket="b1_s32", kind="real")
    padding = delta("inf2_serve_bucket_tokens_total", bucket="b1_s32", kind="padding")
    assert real >= 4 and real + padding == 32 * delta("inf2_serve_batches_total", bucket="b1_s32")
    # A whole answer arrives at once: no first-token time to observe, only its duration.
    assert delta("inf2_serve_request_duration_seconds_count") == 1
    assert delta("inf2_serve_time_to_first_token_seconds_count") == 0
    streamed = get(server.url + "/metrics")[1]
    list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5, stream=True))
    now = get(server.url + "/metrics")[1]
    ttft = "inf2_serve_time_to_first_token_seconds"
    assert metric(now, f"{ttft}_count") - metric(streamed, f"{ttft}_count") == 1
    first = metric(now, f"{ttft}_sum") - metric(streamed, f"{ttft}_sum")
    whole = metric(now, "inf2_serve_request_duration_seconds_sum") - metric(
        streamed, "inf2_serve_request_duration_seconds_sum"
    )
    assert 0 < first < whole  # the first token came before the last
    assert metric(after, "inf2_serve_queue_depth") == 0
    assert metric(after, "inf2_serve_ready") == 1


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


def test_client_disconnect_frees_its_slot(server, client):
    """A client that leaves while its request waits to be batched: the request leaves the
    queue (50 ms of batching wait here) and is counted, and nothing stays in flight."""
    before = get(server.url + "/metrics")[1]
    host = urlparse(server.url)
    body = json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 60}).encode()
    with socket.create_connection((host.hostname, host.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
    now = _wait_for_one_disconnect(server, before)
    assert metric(now, "inf2_serve_queue_depth") == 0
    # the slot is free: the server still answers
    assert client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3).choices


def test_streaming_client_that_leaves_frees_its_row(server, client):
    """A streaming client that closes after the response headers (63 tokens to go): its row
    is marked finished, the request is counted as disconnected, nothing stays in flight."""
    before = get(server.url + "/metrics")[1]
    host = urlparse(server.url)
    body = json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 63, "stream": True})
    with socket.create_connection((host.hostname, host.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        assert s.recv(12) == b"HTTP/1.1 200"
    _wait_for_one_disconnect(server, before)
    assert client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3).choices


def test_lifecycle_readiness_full_queue_and_sigterm_drain(release, reference, tmp_path):
    """A fresh server with one queue slot and a long batching wait: /health before /ready;
    a burst gets 503 + Retry-After for all but the one queued request; SIGTERM runs that
    request at once to its full answer, refuses new connections, and exits 0."""
    with ServerProcess(
        release, tmp_path / "serve.log", "--max-queue", "1", "--max-wait-ms", "60000"
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

        host = urlparse(url)
        prompts = [[1, 40 + i, 7] for i in range(6)]
        conns = [http.client.HTTPConnection(host.hostname, host.port, timeout=120) for _ in prompts]
        for c in conns:
            c.connect()
        for c, p in zip(conns, prompts, strict=True):  # a burst: all sent before any answer
            body = json.dumps({"model": MODEL, "prompt": p, "max_tokens": 20})
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})

        def answer(c: http.client.HTTPConnection) -> tuple[int, str | None, dict]:
            r = c.getresponse()
            return r.status, r.getheader("Retry-After"), json.loads(r.read())

        with ThreadPoolExecutor(len(conns)) as pool:
            futures = [pool.submit(answer, c) for c in conns]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in futures) < 5:  # the 503s come at once
                assert time.monotonic() < deadline, s.output()
                time.sleep(0.01)
            # the one admitted request still waits in the queue (60 s for a partner)
            (admitted,) = [i for i, f in enumerate(futures) if not f.done()]
            rejected = [f.result() for f in futures if f.done()]
            assert [r[0] for r in rejected] == [503] * 5
            assert all(r[1] for r in rejected)
            assert "queue is full" in rejected[0][2]["error"]["message"]

            s.terminate()
            sigterm = time.monotonic()
            deadline = time.monotonic() + 60
            while True:  # stops accepting
                try:
                    socket.create_connection((host.hostname, host.port), timeout=1).close()
                except OSError:
                    break
                assert time.monotonic() < deadline, "still accepting after SIGTERM"
                time.sleep(0.02)
            status, _, body = futures[admitted].result(timeout=120)
            assert time.monotonic() - sigterm < 45  # run at once, not after its 60 s wait
        assert status == 200
        assert body["choices"][0]["token_ids"] == reference(prompts[admitted], 20)
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


def _engine_with_tokenizer(ids: list[int], *, vocab: int = 100, max_seq: int = 32):
    from types import SimpleNamespace

    calls: list[str] = []

    def tokenizer(text: str) -> _Tokenized:
        calls.append(text)
        return _Tokenized(ids)

    model = SimpleNamespace(max_seq=max_seq)
    return SimpleNamespace(tokenizer=tokenizer, vocab=vocab, model=model), calls


def test_tokenizer_ids_outside_the_vocabulary_are_a_400_not_a_crash():
    """A tokenizer with added tokens beyond the model's embedding: its ids must be refused
    like a client's, or the device would index past the embedding."""
    import asyncio

    from pipeline.server.app import _token_ids
    from pipeline.server.protocol import ApiError, parse_request

    engine, _ = _engine_with_tokenizer([5, 100, 7])
    req = parse_request({"model": MODEL, "prompt": "hello"})
    with pytest.raises(ApiError, match=r"the tokenizer gave token ids \[100\]") as e:
        asyncio.run(_token_ids(engine, "hello", req))
    assert e.value.status == 400
    engine, _ = _engine_with_tokenizer([5, 99, 7])
    assert asyncio.run(_token_ids(engine, "hello", req)) == [5, 99, 7]


def test_a_prompt_too_long_for_any_bucket_is_refused_before_tokenizing():
    import asyncio

    from pipeline.server.app import MAX_CHARS_PER_POSITION, _token_ids
    from pipeline.server.protocol import ApiError, parse_request

    engine, calls = _engine_with_tokenizer([1])
    text = "x" * (32 * MAX_CHARS_PER_POSITION + 1)
    req = parse_request({"model": MODEL, "prompt": text})
    with pytest.raises(ApiError, match="cannot fit the largest bucket") as e:
        asyncio.run(_token_ids(engine, text, req))
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
    from pipeline.plan.buckets import Bucket

    cases = [([1, 17, 42, 99, 5], 12), ([3, 3, 3], 20), ([200, 100, 50, 25, 12, 6, 3, 1], 9)]
    for (p, n), (q, m) in zip(cases, cases[1:] + cases[:1], strict=True):
        both = model.session(Bucket(2, 64)).generate([p, q], max(n, m), model.eos_token_id)
        assert both[0][:n] == reference(p, n)
        assert both[1][:m] == reference(q, m)


def test_session_on_tokens_streams_each_step_and_can_stop(reference):
    """The runtime hook under streaming: one call per step with each row's token, equal to
    the result; True stops the loop there."""
    from pipeline.plan.buckets import Bucket

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
    from pipeline.server.app import _listen

    with _listen("localhost", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    with pytest.raises(InputError, match=r"^--host 192\.0\.2\.1: cannot listen there"):
        _listen("192.0.2.1", 0)  # TEST-NET-1: never this machine's
