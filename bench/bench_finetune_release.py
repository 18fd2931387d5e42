"""A fine-tune's release beside the first release of its architecture (issue 16).

Release model A (the tiny model, seed 1) into a fresh store: every bucket compiles. Then
release model B, the same config.json with other weights (seed 2), into the same store:
its graphs are cache hits and only its weights are prepared and uploaded. Both are run as a
user runs them, ``inf2-pipeline release CONFIG --json`` in a fresh process; the baseline is
the first release, measured in the same run (it is also what B cost before issue 16, when
the weights were in every bucket's key).

    python bench/bench_finetune_release.py [--seqs 32,64] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.tiny_model import write_tiny_model

CLI = [sys.executable, "-c", "from pipeline.cli import main; main()"]


def release(config: Path, version: str, jobs: int, work: Path) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run(
        [
            *CLI,
            "release",
            str(config),
            "--version",
            version,
            "--json",
            "-j",
            str(jobs),
            "--workdir",
            str(work),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - start, json.loads(done.stdout)


def write_config(root: Path, name: str, ckpt: Path, seqs: list[int]) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(
        f"model: {{name: bench-ft, checkpoint: {ckpt}, dtype: float32}}\n"
        "target: {backend: cpu, instance_type: inf2.xlarge, tp_degree: 1}\n"
        f"buckets: {{batch_sizes: [1], sequence_lengths: {json.dumps(seqs)}}}\n"
        "compiler: {auto_cast_type: fp32, timeout_s: 900}\n"
        f"store: {root / 'store'}\n"
    )
    return path


def summary(data: dict) -> str:
    c = data["compile"]
    w = c["weights"]
    # Compile puts every blob in the store (the cache is the release store), so publish
    # itself uploads nothing new here: the size of the weights entry is what B adds.
    size = sum(f["size"] for f in w["files"])
    return (
        f"{c['compiled']} of {len(c['buckets'])} buckets compiled, weights {w['status']}"
        f" ({w['seconds']:.1f} s, {size / 1e6:.2f} MB)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32,64", help="sequence lengths of the grid (batch 1)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    a = write_config(root, "a", write_tiny_model(root / "a", seed=1), seqs)
    b = write_config(root, "b", write_tiny_model(root / "b", seed=2), seqs)
    first_s, first = release(a, "a", args.jobs, root / "work-a")
    second_s, second = release(b, "b", args.jobs, root / "work-b")
    assert second["compile"]["compiled"] == 0, second["compile"]
    print(f"release of a fine-tune, {len(seqs)} bucket(s) of the tiny model, cpu backend:")
    print(f"  baseline: model A, first release  {first_s:7.2f} s   {summary(first)}")
    print(f"  model B, same config, new weights {second_s:7.2f} s   {summary(second)}")
    ratio = second_s / first_s
    print(f"  ratio B / A                       {ratio:7.3f}   (B {1 / ratio:.1f}x faster)")


if __name__ == "__main__":
    main()
