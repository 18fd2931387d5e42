"""Where a CUDA decode step spends its time: attention variants alone, and the kernels of a
whole step of the project's decoder (and of the gpt-fast peer, when present), on one GPU.

    python bench/profile_cuda_decode.py [--peer DIR] [--out F.json] [--quick]

1. Attention alone, for decode (one query token per row) over a KV cache of S positions of
   which ``filled`` hold tokens, at the shapes of bench_cuda_decode.py (32 query / 8 KV heads,
   head dim 64, bf16), 16 calls on 16 caches (one per layer) recorded as one CUDA graph
   (caches [B, KV, S, D] here, the layout before 2026-12-01):

   - ``sdpa_gqa_mask``: SDPA with a boolean mask over the whole cache and ``enable_gqa``
     (the decoder before 2026-12-01);
   - ``sdpa_grouped``: the query heads that share a KV head folded into the query length,
     so the cache is read in place by a kernel without GQA support;
   - ``matmul_grouped``: the same as two batched matmuls and a softmax;
   - ``*_tier``: the same over the smallest power of two ≥ ``filled`` (a decode graph per
     filled length) instead of all S positions.

2. A whole decode step of ``pipeline.compile.decoder.Decode`` as it is now (Llama-3.2-1B
   shape, random weights, torch.compile with the cuda backend's inductor options; attending
   the tier that holds the filled positions, as the runtime does): ms per step (CUDA graph
   replay) and the kernels of one step (torch.profiler), grouped by what they do.

3. The same table for gpt-fast's decode (``--peer``: a copy of ../shared/peers/gpt-fast).

Exploration, not the product's benchmark: figures go to bench/RESULTS.md beside the numbers
of bench_cuda_decode.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

H, KV, D = 32, 8, 64
LAYERS = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- attention variants (q [B, H, 1, D]; caches [B, KV, S, D]; pos [B, 1]) ------------------


def _mask(pos, n: int):
    return torch.arange(n, device=pos.device) <= pos[..., None]  # [B, T, n]


def sdpa_gqa_mask(q, k, v, pos, window=None):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=_mask(pos, k.shape[2])[:, None], enable_gqa=True
    )


def _grouped(q, k, pos):
    b, h, t, d = q.shape
    g = h // k.shape[1]
    qg = q.reshape(b, k.shape[1], g * t, d)
    mask = _mask(pos, k.shape[2])[:, None, None].expand(b, 1, g, t, k.shape[2])
    return qg, mask.reshape(b, 1, g * t, k.shape[2])


def sdpa_grouped(q, k, v, pos, window=None):
    qg, mask = _grouped(q, k, pos)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(q.shape)


def matmul_grouped(q, k, v, pos, window=None):
    qg, mask = _grouped(q, k, pos)
    s = (qg @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    p = s.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
    return (p @ v).reshape(q.shape)


def tiered(fn, n: int):
    def run(q, k, v, pos):
        return fn(q, k[:, :, :n], v[:, :, :n], pos)

    run.__name__ = f"{fn.__name__}_tier"
    return run


def attention_table(shapes, reps: int) -> list[dict[str, Any]]:
    rows = []
    for b, s, filled in shapes:
        tier = min(s, 1 << max(7, math.ceil(math.log2(filled))))
        caches = [
            (
                torch.randn(b, KV, s, D, device="cuda", dtype=torch.bfloat16),
                torch.randn(b, KV, s, D, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(LAYERS)
        ]
        q = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16)
        pos = torch.full((b, 1), filled - 1, device="cuda", dtype=torch.long)
        ref = None
        for fn in (
            sdpa_gqa_mask,
            sdpa_grouped,
            matmul_grouped,
            tiered(sdpa_grouped, tier),
            tiered(matmul_grouped, tier),
        ):
            torch._dynamo.reset()
            f = torch.compile(fn, fullgraph=True, dynamic=False)

            def layers(f=f, q=q, pos=pos, caches=caches):
                return [f(q, k, v, pos) for k, v in caches]

            out = layers()[0]
            if ref is None:
                ref = out.float()
            err = (out.float() - ref).abs().max().item()
            ms = graph_ms(layers, reps)
            rows.append(
                {
                    "batch": b,
                    "seq": s,
                    "filled": filled,
                    "variant": fn.__name__,
                    "tier": tier if fn.__name__.endswith("_tier") else s,
                    "ms_16_layers": round(ms, 4),
                    "max_abs_vs_first": err,
                }
            )
            log(f"attention b{b} s{s} filled {filled} {fn.__name__}: {ms:.4f} ms / 16 layers")
    return rows


def graph_ms(fn, reps: int) -> float:
    """Mean ms of ``fn`` recorded as one CUDA graph and replayed ``reps`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


# --- whole decode steps --------------------------------------------------------------------


CATEGORIES = (  # first match wins; names of inductor, cuBLAS and flash/efficient kernels
    ("attention", ("attention", "fmha", "flash", "sdpa", "softmax", "bmm")),
    ("matmul", ("gemm", "gemv", "sm90", "cutlass", "mm_", "_mm", "splitk", "matmul", "xmma")),
    ("argmax", ("argmax", "max_")),
    ("copy/cache", ("copy", "scatter", "index", "cat", "repeat")),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "fused elementwise"


def kernel_table(step, steps: int = 5) -> dict[str, Any]:
    """GPU time per step of each kernel (launched eagerly, so the profiler sees each)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time / steps / 1e3  # ms per step
            counts[e.name] += 1
    by_cat: dict[str, float] = collections.defaultdict(float)
    for name, ms in per_kernel.items():
        by_cat[category(name)] += ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {
        "gpu_ms_per_step": round(sum(per_kernel.values()), 4),
        "kernels_per_step": sum(counts.values()) // steps,
        "by_category_ms": {
            k: round(v, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])
        },
        "top_kernels_ms": [[n[:120], round(ms, 4), counts[n] // steps] for n, ms in top],
    }


def project_step(batch: int, seq: int, filled: int) -> tuple[Any, float]:
    """(one eager step, ms per step replayed as a CUDA graph) of the project's decoder,
    attending the tier that holds ``filled`` positions, as the runtime does."""
    from bench_cuda_decode import SHAPES, llama_config

    from pipeline.compile import decoder as dec
    from pipeline.compile.backends.aoti import CUDA_OPTIONS
    from pipeline.runtime.graph_abi import key_tiers

    cfg = llama_config(SHAPES["llama-3.2-1b"])
    model = dec.build(cfg, torch.bfloat16, "cuda", dec.Decode)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    cache = [torch.zeros(16, seq, batch, KV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
    keys = torch.arange(next(n for n in key_tiers(seq) if n >= filled), device="cuda")
    tokens = torch.randint(3, 128256, (batch, 1), device="cuda")
    pos = torch.full((batch,), filled - 1, device="cuda", dtype=torch.long)
    torch._dynamo.reset()
    for k, v in CUDA_OPTIONS.items():
        setattr(torch._inductor.config, k, v)
    f = torch.compile(model, fullgraph=True, dynamic=False)

    def step():
        with torch.no_grad():
            return f(tokens, pos, *cache, keys)

    step()
    return step, graph_ms(step, 50)


def peer_step(peer: Path, batch: int, seq: int, filled: int) -> tuple[Any, float]:
    sys.path.insert(0, str(peer))
    from model_gptfast import ModelArgs, Transformer

    args = ModelArgs(
        block_size=4096,
        n_layer=16,
        n_head=32,
        n_local_heads=8,
        dim=2048,
        intermediate_size=8192,
        vocab_size=128256,
        rope_base=500000.0,
    )
    with torch.device("meta"):
        m = Transformer(args)
    m = m.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    m.output.weight = m.tok_embeddings.weight
    with torch.device("cuda"):
        m.setup_caches(batch, seq)

    def decode_one_token(model, x, input_pos):
        return torch.argmax(model(x, input_pos)[:, -1], dim=-1, keepdim=True)

    torch._dynamo.reset()
    torch._inductor.config.coordinate_descent_tuning = True
    f = torch.compile(decode_one_token, fullgraph=True, dynamic=False)
    x = torch.randint(3, 128256, (batch, 1), device="cuda")
    ip = torch.tensor([filled - 1], device="cuda", dtype=torch.int)

    def step():
        with torch.no_grad():
            return f(m, x, ip)

    step()
    return step, graph_ms(step, 50)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", type=Path, default=REPO / "peers" / "gpt-fast")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="attention only")
    ap.add_argument("--no-peer", action="store_true", help="skip the gpt-fast peer")
    ap.add_argument("--steps-only", action="store_true", help="whole steps only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_cuda_decode: skipped, no CUDA GPU", file=sys.stderr)
        return
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:
        text = json.dumps(result, indent=1)
        if args.out:
            args.out.write_text(text)

    shapes = [
        (1, 256, 200),
        (1, 2048, 200),
        (1, 2048, 2000),
        (8, 256, 200),
        (32, 256, 200),
        (32, 2048, 200),
        (32, 2048, 2000),
    ]
    if not args.steps_only:
        result["attention"] = attention_table(shapes, reps=200)
    save()
    if args.quick:
        print(json.dumps(result, indent=1))
        return
    steps = result["steps"] = {}
    cases = [(32, 256, 200), (1, 256, 200), (1, 2048, 200), (32, 2048, 200)]
    for b, s, filled in cases:
        label = f"project b{b}_s{s} filled {filled}"
        step, ms = project_step(b, s, filled)
        steps[label] = {"graph_ms": round(ms, 4), **kernel_table(step)}
        log(f"{label}: {ms:.4f} ms/step")
        save()
    if (args.peer / "model_gptfast.py").is_file() and not args.no_peer:
        for b, s, filled in [(32, 264, 200), (1, 264, 200)]:
            step, ms = peer_step(args.peer, b, s, filled)
            label = f"gpt-fast b{b}_s{s} filled {filled}"
            steps[label] = {"graph_ms": round(ms, 4), **kernel_table(step)}
            log(f"{label}: {ms:.4f} ms/step")
            save()
    save()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
