"""``serve``'s engine in a process of its own (``pipeline.server.engine_process``): it answers
as the engine in a thread does, it never outlives the server, its death fails its requests
and stops the server, and its load errors reach the server's exit code and one line."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, InputError
from tests.serve_helpers import REPO, ServerProcess, get, metric, post

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "tiny-llama"
STEP_DELAY_S = 0.03


@pytest.fixture(scope="module")
def release(installed):
    return installed[1]


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts: it runs nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status or "\nState:\tX" in status


def wait_until(what, timeout: float = 60.0, message: str = "timed out") -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


def completion(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    status, body, _ = post(
        url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    )
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def together(url: str, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """Every (prompt, max_tokens) sent at once, one thread each; the answers in order."""
    got: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda i=i, p=p, n=n: got.__setitem__(i, completion(url, p, n)))
        for i, (p, n) in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [got[i] for i in range(len(prompts))]


def test_load_errors_pickle_whole():
    """The engine's process sends its load error to the server's, which exits by its code
    with its one line: every field and the class survive."""
    e = pickle.loads(pickle.dumps(ConfigError("r.yaml", "bad", "fix it", line=3, field="x")))
    assert type(e) is ConfigError and e.exit_code == 2 and e.line == 3
    assert e.one_line() == "r.yaml:3: x: bad (fix it)" == str(e)
    assert pickle.loads(pickle.dumps(InputError("a", "b"))).one_line() == "a: b"


def test_thread_and_process_engines_answer_alike(release, tmp_path):
    """The same prompts, sent together, get the same tokens from either way of running the
    engine; each server's log says which it runs."""
    prompts = [([1, 2, 3], 6), ([7], 9), ([4, 4, 4, 4, 4], 3), ([9, 8], 12)]
    answers = {}
    for flag in ("--engine-process", "--no-engine-process"):
        with ServerProcess(release, tmp_path / f"{flag}.log", flag) as s:
            s.wait_ready()
            answers[flag] = together(s.url, prompts)
            kids = children(s.proc.pid)
            assert s.stop() == 0
            log = s.output()
        if flag == "--engine-process":
            assert len(kids) == 1 and "engine in its own process" in log, log
        else:
            assert kids == [] and "engine in a thread" in log, log
    assert answers["--engine-process"] == answers["--no-engine-process"]
    assert [len(a) for a in answers["--engine-process"]] == [n for _, n in prompts]


def test_the_engine_ignores_sigint_and_dies_with_the_server(release, tmp_path):
    """^C reaches the whole process group: the engine leaves draining to the server. A
    server killed outright (SIGKILL: no drain, no cleanup) takes its engine with it."""
    with ServerProcess(release, tmp_path / "serve.log") as s:
        s.wait_ready()
        (engine,) = children(s.proc.pid)
        os.kill(engine, signal.SIGINT)
        time.sleep(0.5)
        assert not gone(engine)
        assert completion(s.url, [1, 2], 4)
        s.proc.kill()
        s.proc.wait()
        wait_until(lambda: gone(engine), 30, "the engine outlived its server")


def test_a_dead_engine_fails_its_requests_and_stops_the_server(release, tmp_path):
    """The engine's process killed mid-stream: the stream ends with an error naming it (no
    hang), /ready says failed, and the server exits 1 saying why."""
    with ServerProcess(release, tmp_path / "serve.log", step_delay_s=STEP_DELAY_S) as s:
        s.wait_ready()
        (engine,) = children(s.proc.pid)
        import http.client
        from urllib.parse import urlparse

        host = urlparse(s.url)
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=60)
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 60, "stream": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # it runs
        os.kill(engine, signal.SIGKILL)
        rest = response.read().decode()
        conn.close()
        assert "the engine's process was killed by signal 9" in rest, rest
        assert s.proc.wait(60) == 1
        assert "the engine's process was killed by signal 9" in s.output()


def test_a_load_error_in_the_engine_is_the_servers_one_line(release, tmp_path):
    """A release that passes serve's first check (sizes) but not loading (its weights' bytes
    changed): the engine's process fails to load, and serve exits as a load error does,
    one line, no traceback."""
    broken = tmp_path / "release"
    shutil.copytree(release, broken)
    graph = next(p for p in sorted(broken.rglob("decode.pt2")) if not p.is_symlink())
    size = graph.stat().st_size
    graph.chmod(0o644)
    with open(graph, "r+b") as f:  # the zip's directory zeroed, the size kept
        f.seek(size - 256)
        f.write(bytes(256))
    env = dict(os.environ, PYTHONPATH=str(REPO), CI="true")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pipeline.cli import main; main()",
            "serve",
            str(broken),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode in (1, 2) and len(errors) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_prefill_merge_answers_as_prefills_by_length_do(release, tmp_path):
    """Prompts of different prefill lengths sent together, while a slowed step keeps them
    waiting for one admission: with --prefill-merge they may share a call at the longer
    length (right-padded further), or the calls its measured costs make cheapest (auto), and
    every answer is the one prefills by length give. The auto way also bounds each
    iteration's prefills by their timed cost (--prefill-stall auto), which it logs."""
    prompts = [([1, 2, 3], 5), (list(range(3, 40)), 4), ([7, 8], 6), (list(range(5, 25)), 3)]
    answers = {}
    # the last: --prefill-merge auto, the default
    ways = (("--prefill-merge", "0"), ("--prefill-merge", "64"), ("--prefill-stall", "auto"))
    for i, flags in enumerate(ways):
        log = tmp_path / f"serve{i}.log"
        flags = (*flags, "--max-prefills", "8") if i else flags
        with ServerProcess(release, log, *flags, step_delay_s=STEP_DELAY_S) as s:
            s.wait_ready()
            answers[flags] = together(s.url, prompts)
            assert s.stop() == 0
    assert "prefills stall at most" in log.read_text()
    by_length, merged, cheapest = answers.values()
    assert merged == by_length == cheapest and [len(a) for a in merged] == [n for _, n in prompts]


def test_a_broken_tokenizer_loaded_early_is_the_servers_one_line(release, tmp_path):
    """A release whose tokenizer.json is not JSON (its size kept, so serve's first check
    passes): the front loads it while the engine loads the release, and once the engine
    has loaded that same release, serve exits 2 with one line naming the tokenizer."""
    broken = tmp_path / "release"
    shutil.copytree(release, broken)
    tokenizer = next(p for p in sorted(broken.rglob("tokenizer.json")) if not p.is_symlink())
    tokenizer.chmod(0o644)
    tokenizer.write_bytes(b"{" * tokenizer.stat().st_size)
    env = dict(os.environ, PYTHONPATH=str(REPO), CI="true")
    cli = "from pipeline.cli import main; main()"
    r = subprocess.run(
        [sys.executable, "-c", cli, "serve", str(broken), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert "tokenizer" in errors[0] and "Traceback" not in r.stderr


def test_prompts_folded_into_steps_answer_as_prefilled_apart(release, tmp_path):
    """``--fold-prompts always``, one admission an iteration: the first request opens a
    bucket of two rows, the second joins it while the first runs and rides in its step (a
    mixed call; the demo's b2 buckets have a mixed graph for 32-token prompts), the others
    spill or wait. Every answer is the one prompts prefilled apart give, and the metrics
    count the folded prefills."""
    prompts = [([1, 2, 3], 20), ([4, 5], 18), ([6, 7, 8, 9], 12), ([10, 11], 9)]
    answers, folded = {}, {}
    for way in ("always", "off"):
        log = tmp_path / f"serve-{way}.log"
        flags = ("--fold-prompts", way, "--max-prefills", "1")
        with ServerProcess(release, log, *flags, step_delay_s=STEP_DELAY_S) as s:
            s.wait_ready()
            answers[way] = together(s.url, prompts)
            status, text = get(s.url + "/metrics")
            assert status == 200
            folded[way] = metric(text, "inf2_serve_prefills_folded_total")
            assert s.stop() == 0
    assert answers["always"] == answers["off"]
    assert [len(a) for a in answers["off"]] == [n for _, n in prompts]
    assert folded["always"] >= 1 and folded["off"] == 0


# A server whose fronts' tokenizers take 2 s more to load, noting when they are loaded, and
# whose engine notes when it starts being made (its calls timed): files under $TIMES.
SLOW_TOKENIZER = """
import os, time
from pipeline.server import loading, service
times = os.environ["TIMES"]
load, make = service.load_tokenizer, loading.make_engine
def slow(d):
    time.sleep(2.0)
    out = load(d)
    open(os.path.join(times, f"tokenizer.{os.getpid()}"), "w").write(repr(time.time()))
    return out
def made(*a, **k):
    open(os.path.join(times, "engine"), "w").write(repr(time.time()))
    return make(*a, **k)
service.load_tokenizer, loading.make_engine = slow, made
from pipeline.cli import main; main()
"""


@pytest.mark.parametrize("fronts", [1, 2])
def test_the_engine_times_its_calls_after_every_fronts_tokenizer(release, tmp_path, fronts):
    """The fronts load their tokenizers while the engine's process loads the release; the
    engine makes itself (timing its calls, which a front's imports would slow) only once
    every front's tokenizer is loaded, with one front or two."""
    times = tmp_path / "times"
    times.mkdir()
    entry = [sys.executable, "-c", SLOW_TOKENIZER, "serve"]
    with ServerProcess(
        release,
        tmp_path / "serve.log",
        "--http-workers",
        str(fronts),
        env={"TIMES": str(times)},
        entry=entry,
    ) as s:
        s.wait_ready()
        assert completion(s.url, [1, 2, 3], 3)
    loaded = [float(p.read_text()) for p in times.glob("tokenizer.*")]
    assert len(loaded) == fronts
    assert float((times / "engine").read_text()) >= max(loaded)
