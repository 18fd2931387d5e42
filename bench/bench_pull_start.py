"""The init container's cold path on this machine: fresh interpreters running ``pull --help``
and a whole ``pull`` of a release from moto's S3 server on loopback, beside two baselines
measured in the same run: the bare interpreter (``python -c pass``) and ``import boto3``
(what the store's clients no longer load). Medians of ``--runs``.

    python bench/bench_pull_start.py [--store-dir artifacts] [--model tiny-llama] \\
        [--channel demo] [--runs 9]

The release comes from a local store (``make demo`` writes one to ``artifacts/``), copied
into a fresh moto bucket first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.s3_server import S3Server  # noqa: E402

AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:3])} ...: {r.stderr.strip()[-300:]}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store-dir", type=Path, default=REPO / "artifacts")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--channel", default="demo")
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    if not (args.store_dir / "models" / args.model).is_dir():
        sys.exit(f"error: --store-dir {args.store_dir}: no model {args.model} (run make demo)")
    import boto3

    py, cli = sys.executable, str(Path(sys.executable).with_name("inf2-pipeline"))
    with S3Server() as s, tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **AWS, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s.url}
        c = boto3.client(
            "s3",
            endpoint_url=s.url,
            region_name="us-east-1",
            **{k.lower(): v for k, v in AWS.items()},
        )
        c.create_bucket(Bucket="bench")
        for p in args.store_dir.rglob("*"):
            rel = p.relative_to(args.store_dir)
            if p.is_file() and rel.parts[0] in ("models", "blobs"):
                c.upload_file(str(p), "bench", f"p/{rel}")
        ways = {
            "python -c pass (baseline)": [py, "-c", "pass"],
            "python -c 'import boto3' (baseline)": [py, "-c", "import boto3"],
            "inf2-pipeline pull --help": [cli, "pull", "--help"],
        }
        pull = [cli, "pull", args.model, "--store", "s3://bench/p", "--channel", args.channel]
        times: dict[str, list[float]] = {k: [] for k in [*ways, "inf2-pipeline pull (whole)"]}
        for i in range(args.runs):
            for name, cmd in ways.items():
                times[name].append(timed(cmd, env))
            times["inf2-pipeline pull (whole)"].append(
                timed([*pull, "--dest", f"{tmp}/dest{i}"], env)
            )
    base = statistics.median(times["python -c pass (baseline)"])
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, medians of {args.runs}")
    for name, xs in times.items():
        m = statistics.median(xs)
        print(f"  {name:40} {m * 1e3:7.0f} ms (min {min(xs) * 1e3:.0f}) {m / base:5.1f}× bare")


if __name__ == "__main__":
    main()
