"""The per-request sampler (``pipeline.runtime.sampling``) on its own: whether cpu and cuda
draw the same tokens from the same logits, and what one ``sample`` call costs beside the
greedy argmax of the same logits (the baseline, measured in the same run), at 1, 8 and 32
rows of Llama 3's vocabulary. Host read of the tokens included in both.

    python bench/bench_sampler.py [--vocab 128256] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from pipeline.runtime.sampling import SamplingParams, sample, uniform  # noqa: E402


def timed(fn, device: str, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev, v = args.device, args.vocab
    torch.manual_seed(0)
    logits = torch.randn(32, v) * 3
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, top_k=0 if i % 2 else 50, seed=i)
        for i in range(32)
    ]
    if dev != "cpu":
        seeds, steps = torch.tensor([0, 1, 2**61 + 12345, 7]), torch.tensor([0, 5, 9, 2**40])
        same = torch.equal(uniform(seeds, steps, v), uniform(seeds.to(dev), steps.to(dev), v).cpu())
        cpu, gpu = sample(logits, params, [0] * 32), sample(logits.to(dev), params, [0] * 32)
        print(f"noise cpu == {dev}: {same}; tokens cpu == {dev}: {torch.equal(cpu, gpu.cpu())}")
    x = logits.to(dev)
    print(
        f"{'rows':>4} {'argmax ms':>10} {'temperature ms':>15} {'× argmax':>9} "
        f"{'top_p+top_k ms':>15} {'× argmax':>9}"
    )
    for rows in (1, 8, 32):
        plain = [SamplingParams(temperature=0.7, seed=i) for i in range(rows)]
        base = timed(lambda r=rows: x[:r].argmax(dim=1).tolist(), dev)
        hot = timed(lambda r=rows, p=plain: sample(x[:r], p, [0] * r).tolist(), dev)
        cut = timed(lambda r=rows: sample(x[:r], params[:r], [0] * r).tolist(), dev)
        print(
            f"{rows:>4} {base:>10.3f} {hot:>15.3f} {hot / base:>8.1f}× {cut:>15.3f} "
            f"{cut / base:>8.1f}×"
        )


if __name__ == "__main__":
    main()
