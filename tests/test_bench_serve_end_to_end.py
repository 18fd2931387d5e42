"""The serve benches end to end: ``bench/bench_serve.py`` on the demo's cpu release, with the
flags a device round passes (client processes, the lone way's own count, a variant, rounds),
and ``bench/bench_engine_host.py`` on its simulated device with serve's default flags. A
bench path that breaks costs a device session (the twenty-eighth round's replay failed after
its servers were ready), while here it costs seconds. Figures are not asserted, only that
every way ran and answered."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
         "--ways", "lone,serve", "--variant", "front1=--http-workers 1", "--json", str(out)],
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
