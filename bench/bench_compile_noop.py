"""No-op recompile of a 64-bucket grid (every bucket already in the cache): target < 2 s.

Measured end to end as a user runs it, ``inf2-pipeline compile CONFIG`` in a fresh process,
beside a named baseline measured in the same run: ``inf2-pipeline plan CONFIG`` (a fresh
process that reads the same config and checkpoint and plans, compiling nothing). Also the
library call alone, and the cold hashing of the weights it must do.

    python bench/bench_compile_noop.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.compile.keys import bucket_cache_key
from pipeline.compile.scheduler import compile_release
from pipeline.contracts.digests import weights_digest
from pipeline.plan.config import load_config
from pipeline.store import open_store
from pipeline.store.blobs import put_blob
from pipeline.store.cache import CacheEntry, write_cache_entry
from pipeline.tiny_model import write_tiny_model

TARGET_S = 2.0
GRID = {
    "batch_sizes": [1, 2, 4, 8, 16, 32, 64, 128],
    "sequence_lengths": [128 * 2**i for i in range(8)],
}
CLI = [sys.executable, "-c", "from pipeline.cli import main; main()"]


def best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_cli(*args: str) -> None:
    subprocess.run([*CLI, *args], check=True, capture_output=True)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-noop-"))
    ckpt = write_tiny_model(root / "ckpt")
    config = root / "release.yaml"
    config.write_text(
        f"model: {{name: bench, checkpoint: {ckpt}, dtype: float32}}\n"
        "target: {backend: cpu, instance_type: inf2.48xlarge, tp_degree: 1}\n"
        f"buckets: {json.dumps(GRID)}\n"
        f"store: {root / 'store'}\n"
    )
    release = load_config(config)
    assert len(release.buckets) == 64
    # A fully compiled release: one cache entry per bucket (a small stand-in file each).
    store = open_store(str(root / "store"))
    artifact = root / "artifact.bin"
    artifact.write_bytes(b"compiled")
    ref, _ = put_blob(store, artifact, "prefill.pt2")
    for b in release.buckets:
        key = bucket_cache_key(release, b, "cpu")
        write_cache_entry(store, CacheEntry(key=key, bucket=b.name, backend="cpu", files=[ref]))

    work = root / "work"
    cli_s = best_of(3, lambda: run_cli("compile", str(config), "--workdir", str(work), "-j", "4"))
    plan_s = best_of(3, lambda: run_cli("plan", str(config), "--json"))
    lib_s = best_of(3, lambda: compile_release(load_config(config), workdir=work, jobs=4))
    report = compile_release(load_config(config), workdir=work)
    assert {r.status for r in report.results} == {"cached"}
    hash_s = best_of(3, lambda: _cold_hash(ckpt))

    print(f"no-op recompile, {len(release.buckets)} buckets, every one a cache hit:")
    verdict = "within" if cli_s < TARGET_S else "OVER"
    print(f"  inf2-pipeline compile (fresh process)  {cli_s:6.3f} s   {verdict} the {TARGET_S} s")
    print(f"  baseline: inf2-pipeline plan (fresh)   {plan_s:6.3f} s   ratio {cli_s / plan_s:.2f}x")
    print(f"  compile_release() in-process          {lib_s * 1e3:6.1f} ms")
    print(
        f"  cold weights digest (sha256, no memo)  {hash_s * 1e3:6.1f} ms  "
        f"({sum(f.stat().st_size for f in ckpt.glob('*.safetensors')) / 1e6:.1f} MB)"
    )


def _cold_hash(ckpt: Path) -> str:
    from pipeline.contracts import digests

    digests._memo.clear()
    return weights_digest(ckpt)


if __name__ == "__main__":
    main()
