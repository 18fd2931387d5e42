"""CUDA decode speed of the project's decoder without AOTInductor packages (JIT inductor).

Why this exists: on the lent H200 image (torch 2.11.0+cu130) loading *any* AOTInductor
package segfaults inside torch's package loader, so bench_cuda_decode.py (the AOT path)
could not run there. This bench measures the same decoder (pipeline.compile.decoder), the
same explicit in-place KV caches and the same CUDA-graph replay (pipeline.cuda_graphs), with
the decode step compiled by ``torch.compile`` instead of AOTInductor, beside the named
baselines measured in the same run: the memory-bandwidth floor (weight bytes ÷ measured
device copy bandwidth) and Hugging Face eager ``generate``.

    python bench/bench_cuda_decoder_jit.py --out results.json

It also runs a subprocess that compiles and loads a one-layer AOTInductor package, to
record whether the AOT loader works on this machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.compile.decoder import Decode, Prefill
from pipeline.cuda_graphs import StaticGraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda_decode import copy_bandwidth, device_ms

LLAMA_32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_theta=500000.0,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cuda_time(fn, reps: int) -> float:
    """Mean seconds per call (CUDA events), as the AOT bench measures."""
    return device_ms(fn, "cuda", reps) / 1e3


def aoti_probe(workdir: Path) -> str:
    code = (
        "import torch, sys\n"
        "m = torch.nn.Linear(8, 8).cuda()\n"
        "ep = torch.export.export(m, (torch.randn(2, 8, device='cuda'),))\n"
        f"p = torch._inductor.aoti_compile_and_package(ep, package_path='{workdir}/probe.pt2')\n"
        "print('compiled', flush=True)\n"
        "r = torch._inductor.aoti_load_package(p)\n"
        "print('loaded', r(torch.randn(2, 8, device='cuda')).shape, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or [""]
    return f"exit {out.returncode}: {tail[0][:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("cuda-decoder-jit.json"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--hf-steps", type=int, default=32)
    ap.add_argument("--skip-probe", action="store_true")
    ap.add_argument(
        "--coordinate-descent",
        action="store_true",
        help="inductor coordinate-descent kernel tuning (longer compile)",
    )
    args = ap.parse_args()
    if args.coordinate_descent:
        import torch._inductor.config as inductor

        inductor.coordinate_descent_tuning = True
    import transformers

    res: dict = {
        "bench": "cuda-decoder-jit",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    save = lambda: args.out.write_text(json.dumps(res, indent=2))  # noqa: E731
    bw = copy_bandwidth("cuda", 4 << 30)
    cfg = transformers.LlamaConfig(**LLAMA_32_1B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    floor = weight_bytes / bw
    res.update(copy_bandwidth_gbps=bw / 1e9, weight_bytes=weight_bytes, floor_ms=floor * 1e3)
    log(
        f"copy bandwidth {bw / 1e9:,.0f} GB/s, weights {weight_bytes / 1e9:.2f} GB → "
        f"floor {floor * 1e3:.3f} ms/token"
    )
    save()

    # Baseline: Hugging Face eager generate, per decode token (greedy, static length).
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt), device="cuda")

    def gen(n: int):
        return hf.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )

    with torch.inference_mode():
        gen(4)
        t1 = _wall(lambda: gen(1))
        tn = _wall(lambda: gen(1 + args.hf_steps))
    hf_ms = (tn - t1) / args.hf_steps * 1e3
    res["hf_eager_ms_per_token"] = hf_ms
    log(f"HF eager generate: {hf_ms:.2f} ms/token")
    save()

    with torch.device("cuda"):
        model = Prefill(cfg)
    inv_freq = model.rope_inv_freq.float()  # made on the CPU, in fp32 as HF keeps it
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    model.rope_inv_freq = inv_freq.cuda()
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"rope_inv_freq"}, (missing, unexpected)
    # One set of weights: Decode.forward runs on the same module as Prefill.forward.
    decode_c = torch.compile(
        lambda t, p, k, v: Decode.forward(model, t, p, k, v), fullgraph=True, dynamic=False
    )
    prefill_c = torch.compile(model, fullgraph=True, dynamic=False)
    res["decode"] = {}
    for b in [int(x) for x in args.batches.split(",")]:
        seq = args.prompt + args.steps + 8
        shape = (cfg.num_hidden_layers, b, cfg.num_key_value_heads, seq, 64)
        k = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        v = torch.zeros_like(k)
        with torch.inference_mode():
            step = StaticGraph(
                decode_c,
                (
                    torch.zeros((b, 1), dtype=torch.int64, device="cuda"),
                    torch.zeros((b,), dtype=torch.int64, device="cuda"),
                ),
                (k, v),
            )
            toks = torch.randint(0, cfg.vocab_size, (b, seq), device="cuda")
            lengths = torch.full((b,), args.prompt, dtype=torch.int64, device="cuda")
            logits = model(toks, lengths, k, v)  # eager: only fills the cache here
            if b == 1:  # correctness: the first decode step against HF eager
                ref = hf(toks[:, : args.prompt + 1]).logits[:, -1].float()
                got = step(toks[:, args.prompt : args.prompt + 1], lengths)
                res["max_abs_logit_diff_vs_hf_bf16"] = float((got - ref).abs().max())
                res["top1_match_vs_hf"] = bool((got.argmax(-1) == ref.argmax(-1)).all())
            pos = lengths.clone()
            nxt = logits.argmax(-1, keepdim=True)

            def one(step=step, pos=pos):
                nonlocal nxt
                nxt = step(nxt, pos).argmax(-1, keepdim=True)
                pos.add_(1)

            t = cuda_time(one, args.steps)
        res["decode"][b] = {"ms_per_step": t * 1e3, "tokens_per_s": b / t}
        log(f"decode batch {b}: {t * 1e3:.3f} ms/step ({b / t:,.0f} tokens/s)")
        save()
    one_ms = res["decode"][1]["ms_per_step"] if 1 in res["decode"] else None
    if one_ms:
        res["ratio_vs_floor"] = one_ms / (floor * 1e3)
        res["speedup_vs_hf_eager"] = hf_ms / one_ms
        log(
            f"batch 1: {res['ratio_vs_floor']:.2f}× the bandwidth floor (target ≤ 2×), "
            f"{res['speedup_vs_hf_eager']:.1f}× faster than HF eager (target ≥ 20×)"
        )
    # Prefill throughput, 2048-token prompt.
    s = 2048
    k = torch.zeros((cfg.num_hidden_layers, 1, 8, s, 64), dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    toks = torch.randint(0, cfg.vocab_size, (1, s), device="cuda")
    lens = torch.tensor([s], device="cuda")
    with torch.inference_mode():
        t = cuda_time(lambda: prefill_c(toks, lens, k, v), 10)
    res["prefill_2048_tokens_per_s"] = s / t
    log(f"prefill 2048 tokens: {t * 1e3:.2f} ms ({s / t:,.0f} tokens/s)")
    save()
    if not args.skip_probe:
        res["aoti_load_probe"] = aoti_probe(args.out.parent)
        log(f"AOTInductor load probe: {res['aoti_load_probe']}")
    save()


def _wall(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
