"""The engine's host time to admit a burst under ``serve --prefill-stall`` (issue 29).

An iteration places the waiting requests (``Engine._take_admissions``, under the engine's
lock) and, with a stall budget, cuts a prefix of them by what their prefill calls and folds
would cost (``placement.within_stall``). Named baseline, measured in the same run: the
earlier costing, which costed each placement's prefix in turn (one costing per placement,
each a quadratic split), against the current doubling then bisection. Both admit the same
prefix here (checked). Also, same run: how many of the burst each budget admits when the
queue is offered shortest prompt first (``serve --admit-order shortest``) against first
come, first served, and the host time that takes. The engine runs over simulated slots
(``bench/sim_device.py``: b32 × s256, mixed calls up to 512 positions) with the start-up
table of a b32_s256 bucket on an H100 (bench/RESULTS.md, twenty-fifth round, the `stall`
server), 32 prompts of 20–149 tokens waiting and nothing running, as at a closed loop's
opening burst. No device: this is host time only.

    python bench/bench_admissions.py [--reps 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_device import Device, SimSlots, Timings

import pipeline.server.engine as engine_module
from pipeline.contracts.bucket import Bucket
from pipeline.server.jobs import Request
from pipeline.server.prefill_costs import PrefillCosts

B = Bucket(32, 256)
MS = 1e-3
# prefill calls of b32_s256 by (prompts, length), a step and mixed calls by stream length:
# the twenty-fifth round's `stall` server's start-up line (ms)
CALLS = {
    64: {1: 1.64, 2: 1.73, 3: 1.85, 4: 2.06, 5: 2.38, 6: 2.39, 7: 2.64, 8: 2.65, 16: 4.29,
         32: 7.70},
    128: {1: 1.73, 2: 1.88, 3: 2.38, 4: 2.59, 5: 2.99, 6: 3.44, 7: 3.78, 8: 3.94, 16: 7.33,
          32: 13.88},
    256: {1: 1.93, 2: 2.58, 3: 3.44, 4: 4.00, 5: 4.92, 6: 5.65, 7: 6.71, 8: 7.16, 16: 13.89,
          32: 28.68},
}  # fmt: skip
MIXED = {64: 2.03, 128: 2.12, 192: 2.33, 256: 2.55, 384: 2.82, 512: 3.17}
STEP = 1.39
BUDGETS_MS = (2.0, 6.0, 14.0, 1000.0)  # 14: about `auto` (ten steps); 1000: all fit


def per_placement(keys: Any, stall: Any, budget: float) -> int:
    """The baseline: each placement's prefix costed in turn (the engine before 2026-12-06)."""
    mine: dict = {}
    spent: dict = {}
    total = 0.0
    for i, key in enumerate(keys):
        chosen = [*mine.get(key, []), i]
        seconds = stall(key, chosen)
        more = seconds - spent.get(key, 0.0)
        if i and total + more > budget:
            return i
        total += more
        mine[key], spent[key] = chosen, seconds
    return len(keys)


def _costs() -> PrefillCosts:
    table = {(n, length): ms * MS for length, row in CALLS.items() for n, ms in row.items()}
    return PrefillCosts(table, step=STEP * MS, mixed={k: v * MS for k, v in MIXED.items()})


async def _admissions(
    budget: float | None, reps: int, seed: int, order: str = "fcfs"
) -> tuple[list[float], list[int]]:
    timings = Timings(prefill_batch=32)
    slots = SimSlots(B, Device(), timings, 1000)
    model = SimpleNamespace(slots=lambda b: slots, eos_token_ids=())
    costs = _costs()
    engine = engine_module.Engine(
        model,
        [B],
        asyncio.get_running_loop(),
        max_queue=64,
        max_prefills=32,
        call_costs={B: costs},
        prefill_costs={B: costs},
        prefill_stall=budget,
        admit_order=order,
    )
    rng = random.Random(seed)
    seconds, admitted = [], []
    for _ in range(reps):
        reqs = []
        for _ in range(32):
            prompt = [rng.randrange(5, 900) for _ in range(rng.randrange(20, 150))]
            reqs.append(Request(prompt, 12, len(prompt) + 11))
        with engine._cond:
            engine._queue.clear()
            engine._queue.extend(reqs)
            t = time.perf_counter()
            out = engine._take_admissions()
            seconds.append(time.perf_counter() - t)
        admitted.append(len(out))
    return seconds, admitted


def run(reps: int) -> dict:
    current = engine_module.within_stall
    rows = []
    for budget_ms in BUDGETS_MS:
        row: dict[str, Any] = {"budget_ms": budget_ms}
        for name, fn in (("per_placement", per_placement), ("bisection", current)):
            engine_module.within_stall = fn
            try:
                s, n = asyncio.run(_admissions(budget_ms * MS, reps, seed=0))
            finally:
                engine_module.within_stall = current
            row[name] = {"median_us": statistics.median(s) * 1e6, "admitted": n}
        same = row["per_placement"]["admitted"] == row["bisection"]["admitted"]
        row["same_prefixes"] = same
        row["admitted_median"] = statistics.median(row["bisection"]["admitted"])
        row["speedup"] = row["per_placement"]["median_us"] / row["bisection"]["median_us"]
        rows.append(row)
        s, n = asyncio.run(_admissions(budget_ms * MS, reps, seed=0, order="shortest"))
        row["shortest"] = {"median_us": statistics.median(s) * 1e6}
        row["shortest_admitted_median"] = statistics.median(n)
        for name in ("per_placement", "bisection"):
            del row[name]["admitted"]
    plain, _ = asyncio.run(_admissions(None, reps, seed=0))
    return {
        "bench": "admissions",
        "reps": reps,
        "no_budget_median_us": statistics.median(plain) * 1e6,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = run(args.reps)
    for r in out["rows"]:
        print(
            f"budget {r['budget_ms']:g} ms: {r['admitted_median']:g} of 32 admitted; "
            f"per placement {r['per_placement']['median_us']:.0f} µs, bisection "
            f"{r['bisection']['median_us']:.0f} µs: {r['speedup']:.2f}× "
            f"(same prefixes: {r['same_prefixes']}); shortest first "
            f"{r['shortest_admitted_median']:g} of 32 in {r['shortest']['median_us']:.0f} µs"
        )
    print(f"no budget (the count alone): {out['no_budget_median_us']:.0f} µs")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
