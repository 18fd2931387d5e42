"""Where a CUDA decode step spends its time: attention variants alone, and the kernels of a
whole step of the project's decoder (and of the gpt-fast peer, when present), on one GPU.

    python bench/profile_cuda_decode.py [--peer DIR] [--out F.json]
                                        [--quick | --variants | --step-variants]

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

4. ``--variants`` instead: each matrix-vector product of a batch-1 step (with the prologue
   the graph fuses into it) eager through cuBLAS and compiled under each of
   ``GEMV_VARIANTS``, then a whole b1_s256 step under each.

5. ``--step-variants`` instead: whole b1_s256 steps only, under each of ``STEP_VARIANTS``
   (inductor options that change how the fused reductions of a step are generated, where
   the products ran slower inside the step than alone on 2026-12-01), with their kernels.

6. ``--attention-kernel`` instead: decode attention alone (SDPA as the decoder calls it
   against ``pipeline/compile/decode_attention.py``), then whole b1_s256 steps with that
   kernel and PDL launches (``backends/pdl.py``), tuned on inductor's timings and on clean
   ones (``backends/tuning.py``), and SDPA without PDL on clean ones.

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

from pipeline.compile.backends import pdl, tuning  # noqa: E402

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


def kernel_attention_table(reps: int) -> list[dict[str, Any]]:
    """Decode attention as the decoder calls it (position-major caches, the attended prefix):
    SDPA (``decoder.attend``) against ``decode_attention``'s kernel, 16 layers per graph."""
    from pipeline.compile import decode_attention
    from pipeline.compile import decoder as dec
    from pipeline.contracts.graph_abi import key_tiers

    decode_attention.register()
    rows = []
    for b, s, filled in [(1, 256, 200), (1, 2048, 200), (1, 2048, 2000), (8, 256, 200),
                         (32, 256, 200), (32, 2048, 2000)]:  # fmt: skip
        n = next(t for t in key_tiers(s) if t >= filled)
        caches = [
            [torch.randn(s, b, KV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
            for _ in range(LAYERS)
        ]
        q = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(filled // 2, filled, (b, 1), device="cuda")
        keys = torch.arange(n, device="cuda")

        def sdpa(q=q, pos=pos, caches=caches, keys=keys, b=b):
            return [
                dec.attend(q, k, v, pos, keys, None).transpose(1, 2).reshape(b, 1, H * D)
                for k, v in caches
            ]

        def kernel(q=q, pos=pos, caches=caches, n=n):
            return [decode_attention.attend(q, k, v, pos, n, None) for k, v in caches]

        ref = sdpa()[0].float()
        err = (kernel()[0].float() - ref).abs().max().item()
        row = {"batch": b, "seq": s, "filled": filled, "tier": n, "max_abs_diff": err}
        for name, fn in (("sdpa_ms_16_layers", sdpa), ("kernel_ms_16_layers", kernel)):
            row[name] = round(graph_ms(fn, reps), 4)
        rows.append(row)
        log(f"attention {row}")
    return rows


def steps_attention_pdl(save, result) -> dict[str, Any]:
    """Whole b1_s256 steps under the variants below (the first round, on 2026-12-01, also
    ran SDPA and the kernel without PDL on inductor's timings); and how far each one's
    logits are from the first's."""
    from pipeline.compile import decoder as dec
    from pipeline.compile.backends.aoti import CUDA_OPTIONS

    out: dict[str, Any] = {}
    first = None
    pdl_on = {pdl.OPTION: True}
    for name, kernel, extra, clean in (
        ("kernel+pdl, inductor's timings", True, pdl_on, False),
        ("kernel+pdl, clean timings", True, pdl_on, True),
        ("kernel+pdl, clean timings again", True, pdl_on, True),
        ("sdpa, clean timings", False, {}, True),
    ):
        dec.DECODE_ATTENTION_KERNEL = kernel
        start = time.monotonic()
        step, ms = project_step(1, 256, 200, {**CUDA_OPTIONS, **extra}, clean_timings=clean)
        logits, token = (t.float().cpu() for t in step())
        table = {"graph_ms": round(ms, 4), **kernel_table(step)}
        if first is None:
            first = (logits, token)
            table["logits_max_abs"] = float(logits.abs().max())
        else:
            table["logits_max_abs_diff"] = float((logits - first[0]).abs().max())
            table["same_next_token"] = bool((token == first[1]).all())
        table["compile_and_measure_s"] = round(time.monotonic() - start, 1)
        out[name] = table
        result["steps_attention_pdl"] = out
        save()
        log(f"project b1_s256 filled 200 {name}: {ms:.4f} ms/step")
    dec.DECODE_ATTENTION_KERNEL = True
    return out


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


# --- the matrix-vector products of a batch-1 step ------------------------------------------

# (name, in, out, prologue, count per step) at the Llama-3.2-1B shape; the prologue is what the
# decoder's graph fuses into the product's input (RMSNorm; SiLU(gate) × up).
GEMVS = (
    ("qkv", 2048, 3072, "rmsnorm", LAYERS),
    ("o", 2048, 2048, None, LAYERS),
    ("gate_up", 2048, 16384, "rmsnorm", LAYERS),
    ("down", 8192, 2048, "silu_mul", LAYERS),
    ("lm_head", 2048, 128256, "rmsnorm", 1),
)
GEMV_VARIANTS = {  # name: inductor options
    "coordinate_descent": {"coordinate_descent_tuning": True},  # the cuda backend's today
    "extern_mm": {"coordinate_descent_tuning": False},  # cuBLAS for the product
    # Not here: coordinate_descent_search_radius=2 with check_all_directions did not finish
    # compiling the qkv product within 5 minutes on the H200 host (2026-12-01).
}


# Batch-1 step options to compare against the cuda backend's (bench/RESULTS.md: inside the
# step the down projection streamed at 3.1 TB/s against 4.2 alone, qkv and o took 5-7 µs a
# layer against ~3 alone). Not yet measured.
STEP_VARIANTS: dict[str, dict[str, Any]] = {
    "backend": {"coordinate_descent_tuning": True},
    "all_directions": {
        "coordinate_descent_tuning": True,
        "coordinate_descent_check_all_directions": True,
    },
    "multi_kernel": {"coordinate_descent_tuning": True, "triton.multi_kernel": 1},
    "no_persistent": {"coordinate_descent_tuning": True, "triton.persistent_reductions": False},
    "max_autotune": {"coordinate_descent_tuning": True, "max_autotune": True},
    # independent kernels (the K and V cache writes, the q/k rotations) launched as one
    "combo_kernels": {"coordinate_descent_tuning": True, "combo_kernels": True},
}


def _prologue(kind: str | None, x, norm_w):
    if kind == "rmsnorm":
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * norm_w
    if kind == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


def gemv_table(batch: int, reps: int) -> list[dict[str, Any]]:
    """ms and GB/s of each product of a step (all its layers' weights, so L2 holds none), in
    eager cuBLAS and compiled under each of GEMV_VARIANTS, all replayed as CUDA graphs."""
    rows = []
    for name, k, n, prologue, count in GEMVS:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        width = 2 * k if prologue == "silu_mul" else k
        x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        nbytes = sum(w.numel() * w.element_size() for w in ws)

        def products(x=x, ws=ws, prologue=prologue, norm_w=norm_w):
            return [F.linear(_prologue(prologue, x, norm_w), w) for w in ws]

        def plain(x=x, ws=ws, width=k):  # the product alone, eager: cuBLAS's own kernel
            return [F.linear(x[:, :width], w) for w in ws]

        fns = {"cublas_eager_no_prologue": plain}
        for variant, options in GEMV_VARIANTS.items():
            torch._dynamo.reset()
            fns[variant] = torch.compile(products, fullgraph=True, dynamic=False, options=options)
        ref = products()[0].float()
        for variant, fn in fns.items():
            out = fn()[0].float()
            ms = graph_ms(fn, reps)
            err = 0.0 if variant.endswith("no_prologue") else (out - ref).abs().max().item()
            rows.append(
                {
                    "batch": batch,
                    "product": name,
                    "shape": [k, n],
                    "calls": count,
                    "variant": variant,
                    "ms": round(ms, 4),
                    "GBps": round(nbytes / ms / 1e6, 1),
                    "max_abs_vs_eager": err,
                }
            )
            log(f"gemv b{batch} {name} {variant}: {ms:.4f} ms, {nbytes / ms / 1e6:.0f} GB/s")
    return rows


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


def project_step(
    batch: int,
    seq: int,
    filled: int,
    options: dict[str, Any] | None = None,
    seed: int = 0,
    clean_timings: bool = True,
) -> tuple[Any, float]:
    """(one eager step, ms per step replayed as a CUDA graph) of the project's decoder,
    attending the tier that holds ``filled`` positions, as the runtime does; ``options``:
    inductor options instead of the cuda backend's."""
    from bench_cuda_decode import SHAPES, llama_config

    from pipeline.compile import decoder as dec
    from pipeline.compile.backends.aoti import CUDA_OPTIONS
    from pipeline.contracts.graph_abi import key_tiers

    cfg = llama_config(SHAPES["llama-3.2-1b"])
    model = dec.build(cfg, torch.bfloat16, "cuda", dec.Decode)
    torch.manual_seed(seed)  # the same weights, caches and inputs for every variant
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    cache = [torch.randn(16, seq, batch, KV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
    keys = torch.arange(next(n for n in key_tiers(seq) if n >= filled), device="cuda")
    tokens = torch.randint(3, 128256, (batch, 1), device="cuda")
    pos = torch.full((batch,), filled - 1, device="cuda", dtype=torch.long)
    torch._dynamo.reset()
    options = CUDA_OPTIONS if options is None else options
    f = torch.compile(model, fullgraph=True, dynamic=False, options=options)

    def step():
        with torch.no_grad():
            return f(tokens, pos, *cache, keys)

    timings = tuning.clean_timings("cuda" if clean_timings else "default")
    uncached = torch._inductor.config.patch({"autotune_local_cache": False})
    with pdl.launches(options), timings, uncached:  # compiles here, at the first call
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
    ap.add_argument(
        "--variants",
        action="store_true",
        help="batch 1 only: each product under each inductor variant, and a whole b1_s256 "
        "step under each",
    )
    ap.add_argument(
        "--step-variants",
        action="store_true",
        help="batch 1 only: whole b1_s256 steps under each of STEP_VARIANTS",
    )
    ap.add_argument(
        "--attention-kernel",
        action="store_true",
        help="decode attention alone (SDPA against decode_attention's kernel), then whole "
        "b1_s256 steps: the kernel with PDL tuned on inductor's timings and twice on clean "
        "ones (tuning.py), and SDPA without PDL on clean ones",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_cuda_decode: skipped, no CUDA GPU", file=sys.stderr)
        return
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:
        text = json.dumps(result, indent=1)
        if args.out:
            args.out.write_text(text)

    if args.attention_kernel:
        result["attention_kernel"] = kernel_attention_table(reps=200)
        save()
        result["steps_attention_pdl"] = steps_attention_pdl(save, result)
        print(json.dumps(result, indent=1))
        return
    if args.step_variants:
        result["steps_by_options"] = {}
        for variant, options in STEP_VARIANTS.items():
            start = time.monotonic()
            step, ms = project_step(1, 256, 200, options)
            table = {"options": options, "graph_ms": round(ms, 4), **kernel_table(step)}
            table["compile_and_measure_s"] = round(time.monotonic() - start, 1)
            result["steps_by_options"][variant] = table
            log(f"project b1_s256 filled 200 {variant}: {ms:.4f} ms/step")
            save()
        print(json.dumps(result, indent=1))
        return
    if args.variants:
        result["gemv"] = gemv_table(1, reps=200)
        save()
        result["steps_by_variant"] = {}
        for variant, options in GEMV_VARIANTS.items():
            step, ms = project_step(1, 256, 200, options)
            table = {"graph_ms": round(ms, 4), **kernel_table(step)}
            result["steps_by_variant"][variant] = table
            log(f"project b1_s256 filled 200 {variant}: {ms:.4f} ms/step")
            save()
        print(json.dumps(result, indent=1))
        return
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
