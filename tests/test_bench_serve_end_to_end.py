"""The serve benches end to end: ``bench/bench_serve.py`` on the demo's cpu release, with the
flags a device round passes (client processes, the lone way's own count, a variant, rounds, the
servers' rounds in turn), and ``bench/bench_engine_host.py`` on its simulated device with
serve's default flags. A bench path that breaks costs a device session (the twenty-eighth
round's replay failed after its servers were ready), while here it costs seconds. Figures are
not asserted, only that every way ran and answered."""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from bench_serve import run_servers  # noqa: E402


def _trace(path: Path, rows: int = 80) -> Path:
    """A trace of the shared one's form: prompt and answer lengths, scaled by the bench."""
    r = random.Random(0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [
        f"2023-11-16 18:15:{i % 60:02d}.0,{r.randint(20, 600)},{r.randint(2, 60)}"
        for i in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_serve_bench_runs_every_way_a_device_round_asks_for(installed, tmp_path):
    _, model_dir = installed
    out = tmp_path / "serve.json"
    run = subprocess.run(
        [sys.executable, "bench/bench_serve.py", str(model_dir),
         "--trace", str(_trace(tmp_path / "trace.csv")), "--requests", "40",
         "--concurrency", "4", "--client-procs", "2", "--lone-requests", "6", "--rounds", "2",
         "--ways", "lone,serve", "--variant", "front1=--http-workers 1", "--json", str(out),
         "--interleave-servers"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == []
    ways = {w["way"]: w for w in result["ways"]}
    assert set(ways) == {"lone", "serve/2p", "front1/2p"}
    assert ways["lone"]["requests"] == 6
    for w in ways.values():
        assert w["failed_requests"] == 0 and w["answers_differing_from_alone"] == 0
        assert len(w["every_round"]) == 2 and w["output_tokens_per_s"] > 0
        assert all(r["host"]["python_s"] > 0 for r in w["every_round"])  # the host, timed
    assert ways["serve/2p"]["requests"] == ways["front1/2p"]["requests"] == 40
    # both servers up at once, their rounds in turn: serve's first, front1's, serve's second...
    started = sorted(
        (r["started_s"], way) for way in ("serve/2p", "front1/2p") for r in ways[way]["every_round"]
    )
    assert [way for _, way in started] == ["serve/2p", "front1/2p"] * 2


def test_the_serve_bench_can_skip_the_answers_alone(installed, tmp_path):
    """--skip-alone (a device call short of time): no prompt is generated alone, so nothing
    is compared, the ceiling counts every max_tokens, and the run says so."""
    _, model_dir = installed
    out = tmp_path / "serve.json"
    run = subprocess.run(
        [sys.executable, "bench/bench_serve.py", str(model_dir),
         "--trace", str(_trace(tmp_path / "trace.csv")), "--requests", "12",
         "--concurrency", "4", "--ways", "serve", "--skip-alone", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "answers alone in" not in run.stderr + run.stdout  # none was generated
    assert "not compared with the prompt alone" in run.stdout
    result = json.loads(out.read_text())
    assert result["answers_compared_with_alone"] is False and result["errors"] == []
    work = result["workload"]
    assert work["output_tokens"] == work["asked_output_tokens"]
    assert work["output_tokens_are"] == "max_tokens (--skip-alone)"
    (way,) = result["ways"]
    assert way["requests"] == 12 and way["failed_requests"] == 0


def test_servers_run_one_after_another_or_their_rounds_in_turn():
    """``run_servers``: each server's rounds to the end, or, interleaved, every server
    started, then each one's rounds in turn; a server that fails to start drops out, and
    whatever ends the run stops every server started."""

    def server(name: str, rounds: int, log: list[str]):
        log.append(f"{name} up")
        yield
        for r in range(rounds):
            if r:
                yield
            log.append(f"{name}{r + 1}")

    def failed(log: list[str]):
        log.append("x failed")
        return
        yield

    for interleave, want in (
        (False, ["a up", "a1", "a2", "x failed", "b up", "b1", "b2"]),
        (True, ["a up", "x failed", "b up", "a1", "b1", "a2", "b2"]),
    ):
        log: list[str] = []
        saves: list[int] = []
        gens = [server("a", 2, log), failed(log), server("b", 2, log)]
        run_servers(gens, interleave, functools.partial(saves.append, 1))
        assert log == want
        assert saves  # the JSON is written as rounds end

    def stopping(name: str, log: list[str]):
        try:
            yield from server(name, 2, log)
        finally:
            log.append(f"{name} stopped")

    log = []
    saved = iter(range(10))

    def save() -> None:
        if next(saved) == 1:  # both servers up: the run ends here
            raise KeyboardInterrupt

    gens = [stopping("a", log), stopping("b", log)]  # held: no garbage collection closes them
    with pytest.raises(KeyboardInterrupt):
        run_servers(gens, True, save)
    assert log == ["a up", "b up", "a stopped", "b stopped"]


def test_the_simulated_device_bench_serves_with_serve_s_defaults(tmp_path):
    """serve's defaults read the release (``--http-workers auto`` its backend): the simulated
    device's stand-in release must answer what they read."""
    out = tmp_path / "sim.json"
    run = subprocess.run(
        [sys.executable, "bench/bench_engine_host.py", "--trace", str(_trace(tmp_path / "t.csv")),
         "--requests", "24", "--concurrency", "4", "--rounds", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (serve,) = json.loads(out.read_text())["ways"]["serve"]
    assert serve["requests"] == 24 and serve["failed_requests"] == 0 and not serve["errors"]
    assert serve["output_tokens"] > 0
