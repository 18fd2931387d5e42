"""``inf2-pipeline serve`` under a replay of real request lengths, beside two baselines
measured in the same run:

* one at a time: the same requests sent to the same server by a single client;
* direct: ``BucketedModel.generate`` in this process, rows in arrival order in batches of the
  largest bucket batch (no HTTP, no scheduler): what the runtime alone does with the rows.

Request lengths come from the Azure conversation trace (``../shared/traces/``: ContextTokens,
GeneratedTokens), sampled with a fixed seed and scaled so that the trace's p95 request
(prompt + generated) fills the release's largest bucket; longer ones are clipped to fit.
Prompts are random token ids (seeded). Every response is checked against the model's output
for that prompt alone (generated here, one prompt at a time); any difference fails the run.
Loopback only; stops by itself. Figures: requests/s, output tokens/s, and the live padding
efficiency (real / bucket token positions, from the server's /metrics).

    python bench/bench_serve.py pulled/tiny-llama [--requests 300] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.plan.traces import read_lengths  # noqa: E402
from pipeline.runtime import BucketedModel  # noqa: E402
from tests.serve_helpers import ServerProcess, get, metric  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def workload(trace: Path, model: BucketedModel, n: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, max_tokens) from the trace, scaled into the model's buckets."""
    ctx = read_lengths(trace, "ContextTokens")
    gen = read_lengths(trace, "GeneratedTokens")
    totals = sorted(c + g for c, g in zip(ctx, gen, strict=True))
    scale = model.max_seq / totals[int(0.95 * (len(totals) - 1))]
    rng = random.Random(seed)
    vocab = model.vocab_size()
    out = []
    for i in rng.sample(range(len(ctx)), n):
        p = max(1, round(ctx[i] * scale))
        g = max(1, round(gen[i] * scale))
        while model.tokens_needed(p, g) > model.max_seq:  # clip the longest: prompt first
            if p > 1:
                p -= 1
            else:
                g -= 1
        out.append(([rng.randrange(3, vocab) for _ in range(p)], g))
    return out


def replay(url: str, name: str, work, concurrency: int) -> tuple[float, list]:
    """Send every request from ``concurrency`` client threads (keep-alive connections);
    returns (seconds, [(token ids, latency s)] in request order)."""
    host = urlparse(url)
    results: list = [None] * len(work)
    todo = iter(range(len(work)))
    lock = threading.Lock()
    errors: list[str] = []

    def client() -> None:
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=300)
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                break
            prompt, n = work[i]
            body = json.dumps({"model": name, "prompt": prompt, "max_tokens": n})
            t = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = json.loads(r.read())
            if r.status != 200:
                errors.append(f"request {i}: {r.status} {data}")
                continue
            results[i] = (data["choices"][0]["token_ids"], time.perf_counter() - t)
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        sys.exit("error: " + "\n".join(errors[:5]))
    return wall, results


def padding(before: str, after: str, buckets) -> tuple[float, int, int]:
    """(padding efficiency, batches, rows) between two /metrics scrapes."""
    sums = {"real": 0.0, "padding": 0.0, "batches": 0.0, "rows": 0.0}
    for b in buckets:
        for key, name, kw in (
            ("real", "inf2_serve_bucket_tokens_total", {"kind": "real"}),
            ("padding", "inf2_serve_bucket_tokens_total", {"kind": "padding"}),
            ("batches", "inf2_serve_batches_total", {}),
            ("rows", "inf2_serve_batch_rows_total", {}),
        ):
            sums[key] += metric(after, name, bucket=b.name, **kw)
            sums[key] -= metric(before, name, bucket=b.name, **kw)
    real, pad, batches, rows = sums.values()
    return real / (real + pad) if real + pad else 0.0, int(batches), int(rows)


def direct(model: BucketedModel, work) -> tuple[float, list[list[int]], float, float]:
    """BucketedModel alone: rows in arrival order, max_batch at a time while they fit one
    bucket together; each row's answer cut to its own max_tokens. Returns (seconds, answers,
    padding efficiency, rows per batch)."""
    groups: list[list[int]] = []
    for i, (p, g) in enumerate(work):
        last = groups[-1] if groups else None
        if last and len(last) < model.max_batch:
            longest = max([len(p)] + [len(work[j][0]) for j in last])
            most = max([g] + [work[j][1] for j in last])
            if model.tokens_needed(longest, most) <= model.max_seq:
                last.append(i)
                continue
        groups.append([i])
    out: list[list[int]] = [[] for _ in work]
    real = slots = 0
    t0 = time.perf_counter()
    for group in groups:
        rows = [work[i] for i in group]
        n = max(g for _, g in rows)
        got = model.generate([p for p, _ in rows], n)
        bucket = model.select(len(rows), model.tokens_needed(max(len(p) for p, _ in rows), n))
        for i, (p, g), r in zip(group, rows, got, strict=True):
            out[i] = r[:g]
            real += model.tokens_needed(len(p), max(1, len(r[:g])))
        slots += bucket.tokens
    return time.perf_counter() - t0, out, real / slots, len(work) / len(groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("release", type=Path, help="DEST/MODEL, e.g. pulled/tiny-llama (make demo)")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of all three; the best kept")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument(
        "--tolerate-mismatch",
        action="store_true",
        help="count answers that differ from the prompt alone instead of failing (bf16 on a "
        "GPU: kernels of different batch shapes may round differently)",
    )
    args = ap.parse_args()

    model = BucketedModel.load(args.release)
    model.warmup()
    work = workload(args.trace, model, args.requests, args.seed)
    alone = [model.generate([p], g)[0] for p, g in work]  # the truth: each prompt alone
    out_tokens = sum(len(a) for a in alone)
    mismatches: dict[str, int] = {}
    rows: dict[str, dict] = {}

    def keep(label: str, figures: dict) -> None:  # the best round: the least disturbed one
        if label not in rows or figures["seconds"] < rows[label]["seconds"]:
            rows[label] = figures

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        with ServerProcess(args.release, log, "--max-wait-ms", str(args.max_wait_ms)) as s:
            url = s.wait_ready()
            name = json.loads(get(url + "/v1/models")[1])["data"][0]["id"]
            # Rounds alternate the three ways, so that load from other work on the machine
            # falls on all of them alike.
            for _ in range(args.rounds):
                for label, conc in (
                    ("one at a time", 1),
                    (f"{args.concurrency} clients", args.concurrency),
                ):
                    before = get(url + "/metrics")[1]
                    wall, results = replay(url, name, work, conc)
                    after = get(url + "/metrics")[1]
                    wrong = sum(ids != alone[i] for i, (ids, _) in enumerate(results))
                    mismatches[label] = mismatches.get(label, 0) + wrong
                    eff, batches, nrows = padding(before, after, model.buckets)
                    lat = sorted(t for _, t in results)
                    keep(
                        label,
                        {
                            "concurrency": conc,
                            "seconds": wall,
                            "requests_per_s": len(work) / wall,
                            "output_tokens_per_s": out_tokens / wall,
                            "padding_efficiency": eff,
                            "batches": batches,
                            "rows_per_batch": nrows / batches if batches else 0,
                            "p50_latency_s": statistics.median(lat),
                            "p99_latency_s": lat[int(0.99 * (len(lat) - 1))],
                        },
                    )
                d_wall, d_out, d_eff, d_rows = direct(model, work)
                label = "direct BucketedModel"
                wrong = sum(a != b for a, b in zip(d_out, alone, strict=True))
                mismatches[label] = mismatches.get(label, 0) + wrong
                keep(
                    label,
                    {
                        "concurrency": model.max_batch,
                        "seconds": d_wall,
                        "requests_per_s": len(work) / d_wall,
                        "output_tokens_per_s": out_tokens / d_wall,
                        "padding_efficiency": d_eff,
                        "rows_per_batch": d_rows,
                    },
                )
            assert s.stop() == 0, s.output()
    for label, wrong in mismatches.items():
        rows[label]["answers_differing_from_alone"] = wrong
    if any(mismatches.values()) and not args.tolerate_mismatch:
        sys.exit(f"error: answers that differ from the prompt alone: {mismatches}")
    base = rows["one at a time"]
    print(
        f"{len(work)} requests from {args.trace.name} (seed {args.seed}), {out_tokens} output "
        f"tokens, {model.manifest.model} on {model.device}, buckets "
        f"{', '.join(b.name for b in model.buckets)}; best of {args.rounds} rounds; answers "
        f"differing from the prompt alone: {sum(mismatches.values())}"
    )
    head = ("req/s", "tok/s", "padding eff.", "rows/batch", "× 1-at-a-time")
    print(f"{'':22} {head[0]:>8} {head[1]:>8} {head[2]:>12} {head[3]:>10} {head[4]:>13}")
    for label, r in rows.items():
        print(
            f"{label:22} {r['requests_per_s']:8.1f} {r['output_tokens_per_s']:8.1f} "
            f"{r['padding_efficiency']:12.1%} {r.get('rows_per_batch', 0):10.2f} "
            f"{r['requests_per_s'] / base['requests_per_s']:12.2f}×"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "requests": len(work),
                    "rounds": args.rounds,
                    "output_tokens": out_tokens,
                    "device": model.device,
                    "buckets": [b.name for b in model.buckets],
                    "results": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
