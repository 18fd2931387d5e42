"""What the serving host costs beside its device: the real ``serve`` (engine, event loop,
HTTP, SSE) over a simulated device (``bench/sim_device.py``: slots that sleep for an H200's
measured step and prefill times), under ``bench_serve.py``'s replay and clients, on any
machine. No GPU: the figures say how much of the device the host keeps busy.

    python bench/bench_engine_host.py [--buckets b1_s256,b8_s256,b32_s256] [--concurrency 32] \\
        [--rate R] [--way serve= --way coalesce=--coalesce ...] [--timings FILE] [--json FILE]

Baselines, same run: the replay's ceiling on the simulated device (every prefill alone plus
every other token at the largest batch's step per row, as bench_serve.py computes it from
the real device), and the device's own busy time during each way (its share of the wall is
how much of the device the host kept fed). The client threads run in this process; on a
2-core machine they take a share of the cores the server would have on a GPU host, so
compare ways within one run, not with the GPU's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import host_probe  # noqa: E402
from bench_serve import (  # noqa: E402
    TRACES,
    _ms,
    poisson_arrivals,
    replay,
    scrape,
    server_figures,
    way_figures,
    workload,
)
from sim_device import SimModel, Timings  # noqa: E402

from pipeline._files import atomic_write_text  # noqa: E402
from pipeline.contracts.bucket import Bucket  # noqa: E402
from tests.serve_helpers import ServerProcess, metric  # noqa: E402

BUSY = "inf2_sim_device_busy_seconds"


def serve_sim(argv: list[str]) -> None:
    """In the server process: ``inf2-pipeline serve CHECKPOINT ...`` with the simulated model
    (buckets and timings from the environment) in place of a release's; nothing else of the
    server changes."""
    import pipeline.install.installed as installed
    import pipeline.server.service as service
    from pipeline.cli import main

    buckets = [Bucket.parse(b) for b in os.environ["INF2_SIM_BUCKETS"].split(",")]
    path = os.environ.get("INF2_SIM_TIMINGS")
    timings = Timings.load(Path(path) if path else None)
    model = SimModel(Path(argv[0]), buckets, timings)
    # There is no release to check; what serve reads of one (the backend, for --http-workers
    # auto) is a device's, which the simulated model stands in for.
    release = SimpleNamespace(manifest=SimpleNamespace(backend="cuda"))
    installed.open_installed = lambda *a, **k: release
    service._load_model = lambda path, trust=None: model
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    class Metrics(service.Metrics):  # and the device's busy seconds, beside the engine's split
        def __init__(self, shared: bool = False) -> None:
            super().__init__(shared)
            # a registry of its own: --http-workers' summed files hold no callback gauge
            self.sim = CollectorRegistry()
            busy = Gauge(BUSY, "work given", registry=self.sim)
            busy.set_function(lambda: model.sim.busy_s)

        def exposition(self) -> tuple[bytes, str]:
            body, kind = super().exposition()
            return body + generate_latest(self.sim), kind

    service.Metrics = Metrics
    sys.argv = ["inf2-pipeline", "serve", *argv]
    main()


def sim_server(model: SimModel, log: Path, timings: Path | None, flags: list[str]) -> ServerProcess:
    env = {"INF2_SIM_BUCKETS": ",".join(b.name for b in model.buckets)}
    if timings is not None:
        env["INF2_SIM_TIMINGS"] = str(timings)
    entry = [sys.executable, __file__, "--serve-sim"]
    return ServerProcess(model.dir, log, *flags, env=env, entry=entry)


def sim_ceiling(model: SimModel, timings: Timings, work: list[tuple[list[int], int]]) -> float:
    """Seconds: each prompt prefilled alone in the largest-batch bucket that holds it, plus
    every other token at the largest batch's step time per row."""
    largest = max(model.buckets, key=lambda b: (b.batch, -b.seq))
    seconds = 0.0
    for prompt, n in work:
        need = model.tokens_needed(len(prompt), n)
        bucket = max((b for b in model.buckets if b.seq >= need), key=lambda b: (b.batch, -b.seq))
        seconds += timings.prefill(model.slots(bucket).prefill_positions(len(prompt)))
        seconds += (n - 1) * timings.step(largest) / largest.batch
    return seconds


def run_way(
    model: SimModel, args: argparse.Namespace, name: str, flags: list[str], work: Any, tmp: Path
) -> dict[str, Any]:
    with sim_server(model, tmp / f"{name}.log", args.timings, flags) as server:
        url = server.wait_ready(120)
        replay(url, model.dir.name, work[: args.concurrency], args.concurrency, 60)  # warm
        before = scrape(url)
        due = poisson_arrivals(len(work), args.rate, args.seed) if args.rate else None
        host0, t0 = host_probe.snapshot(server.proc.pid), time.monotonic()
        wall, answers, errors = replay(
            url, model.dir.name, work, args.concurrency, 120, arrivals=due
        )
        host = host_probe.delta(host0, host_probe.snapshot(server.proc.pid), time.monotonic() - t0)
        after = scrape(url)
    busy = metric(after, BUSY) - metric(before, BUSY)
    server_side = server_figures(before, after, [b.name for b in model.buckets])
    figures = way_figures(work, None, wall, answers, errors, server_side, args.concurrency)
    return {
        "flags": flags,
        **figures,
        "device_busy_s": busy,
        "device_busy_share": busy / wall,
        "host": host,
    }


def _line(fig: dict[str, Any], ceiling_s: float, tokens: int) -> str:
    e, held = fig["engine_seconds"], fig["held_launches"]
    return (
        f"{fig['output_tokens_per_s']:8.1f} tok/s "
        f"({fig['output_tokens_per_s'] * ceiling_s / tokens:.2f}× ceiling), device busy "
        f"{fig['device_busy_share']:.0%}, TTFT p50/p99/p99 after burst "
        f"{_ms(fig['ttft_p50_s'])}/{_ms(fig['ttft_p99_s'])}/{_ms(fig['ttft_p99_after_burst_s'])}"
        f" ms (server {_ms(fig['server_ttft_p50_s'])}/{_ms(fig['server_ttft_p99_s'])}, queue "
        f"{_ms(fig['server_queue_p50_s'])}/{_ms(fig['server_queue_p99_s'])}, written "
        f"{_ms(fig['server_written_p50_s'])}/{_ms(fig['server_written_p99_s'])}, loop lag "
        f"{_ms(fig['server_loop_lag_p50_s'])}/{_ms(fig['server_loop_lag_p99_s'])}), ITL p50 "
        f"{_ms(fig['itl_p50_s'])}, launches held in time/late {held['in_time']}/{held['late']}"
        f", steps {fig['steps_by_bucket']}, prefills {fig['prefills']} "
        f"({fig['prefills_folded']} folded), model thread s: "
        + " ".join(f"{k} {v:.2f}" for k, v in e.items())
        + (f", errors {fig['errors']}" if fig["errors"] else "")
        + f"; {host_probe.summary(fig.get('host'))}"
    )


def main() -> None:
    if sys.argv[1:2] == ["--serve-sim"]:
        serve_sim(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", default="b1_s256,b8_s256,b32_s256")
    ap.add_argument("--timings", type=Path, help="JSON of sim_device.Timings fields")
    ap.add_argument("--trace", type=Path, default=next((t for t in TRACES if t.is_file()), None))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--scale-to", type=int, metavar="SEQ")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rate",
        type=float,
        help="open loop: requests arrive as a Poisson process of this many a second, sent "
        "from --concurrency connections (bench_serve.py's --rate); default: closed loop",
    )
    ap.add_argument("--rounds", type=int, default=2, help="runs of each way, interleaved")
    ap.add_argument(
        "--way",
        action="append",
        default=[],
        help="NAME=FLAG,FLAG: a server way and its serve flags (repeatable; default serve=)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.trace is None or not args.trace.is_file():
        sys.exit("error: --trace: no trace found (../shared/traces/ or peers/)")
    ways = {}
    for w in args.way or ["serve="]:
        name, _, flags = w.partition("=")
        ways[name] = [f for f in flags.split(",") if f]
    timings = Timings.load(args.timings)
    from pipeline.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ckpt = write_tiny_model(tmp / "tiny-llama", vocab=4096)
        model = SimModel(ckpt, [Bucket.parse(b) for b in args.buckets.split(",")], timings)
        work = workload(args.trace, model, args.requests, args.seed, args.scale_to)
        ceiling_s = sim_ceiling(model, timings, work)
        tokens = sum(n for _, n in work)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name, flags in ways.items():
                fig = run_way(model, args, name, flags, work, tmp)
                results[name].append(fig)
                print(f"round {r + 1} {name:>10}: {_line(fig, ceiling_s, tokens)}", flush=True)
    print(f"ceiling on the simulated device: {tokens / ceiling_s:.1f} tok/s ({ceiling_s:.3f} s)")
    out = {
        "bench": "engine_host",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "buckets": args.buckets,
        "timings": timings.__dict__,
        "requests": len(work),
        "concurrency": args.concurrency,
        "arrivals": f"open loop, Poisson at {args.rate}/s" if args.rate else "closed loop",
        "output_tokens": tokens,
        "ceiling_s": ceiling_s,
        "ceiling_tokens_per_s": tokens / ceiling_s,
        "ways": results,
    }
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
