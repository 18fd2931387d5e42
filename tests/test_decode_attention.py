"""The decode attention kernel (``pipeline.compile.decode_attention``) against SDPA as the
decoder calls it (``decoder.attend``): on the CPU through Triton's interpreter, and on a GPU
in bf16 as the cuda releases run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.compile import decode_attention
from pipeline.compile import decoder as dec

REPO = Path(__file__).resolve().parent.parent

# (batch, query heads, KV heads, head dim, cache length, attended n, window)
SHAPES = [
    (1, 32, 8, 64, 256, 200, None),  # Llama-3.2-1B: groups of 4
    (3, 14, 2, 64, 64, 40, None),  # Qwen2-0.5B: groups of 7, padded to the kernel's 16
    (2, 8, 8, 128, 128, 100, 16),  # no GQA; a sliding window
    (2, 4, 1, 80, 40, 33, None),  # a head dim that is not a power of two
    (4, 8, 2, 64, 300, 300, 50),  # the whole cache, the window across block edges
    (3, 8, 2, 64, 64, 20, 4),  # a row past n + window: nothing visible, 0 as SDPA gives
]


def reference(q, k, v, pos, n, window):
    b, h, _, d = q.shape
    keys = torch.arange(n, device=q.device)[None]
    k, v = (c[:n].permute(1, 2, 0, 3).float() for c in (k, v))  # [B, KV, n, D], as decode reads
    y = dec.attend(q.float(), k, v, pos, keys, window)
    return y.transpose(1, 2).reshape(b, 1, h * d)


def inputs(shape, dtype, device, seed=0):
    b, h, kv, d, s, n, _ = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g).to(device, dtype)
    k = torch.randn(s, b, kv, d, generator=g).to(device, dtype)
    v = torch.randn(s, b, kv, d, generator=g).to(device, dtype)
    # rows at different positions; with more rows, one at the very start and one past what
    # is attended
    pos = torch.randint(n // 2, n, (b, 1), generator=g)
    if b > 2:
        pos[0, 0] = 0
    if b > 1:
        pos[-1, 0] = n + 3
    # every other row of a wider tensor: the kernel must follow the positions' stride
    pos = torch.stack([pos, torch.full_like(pos, -7)], dim=-1)[..., 0]
    return q, k, v, pos.to(device)


INTERPRETED = """
import json, os, sys, torch, triton
real = triton.autotune
block = int(os.environ["BLOCK_S"])
# The interpreter cannot time configs: keep the one under test.
triton.autotune = lambda configs, key, **kw: real(
    [c for c in configs if c.kwargs["BLOCK_S"] == block][:1], key, **kw)
sys.path[:0] = [os.environ["REPO"], os.environ["TESTS"]]
from pipeline.compile import decode_attention
from test_decode_attention import SHAPES, inputs, reference
assert decode_attention.register()
errors = []
for shape in SHAPES:
    q, k, v, pos = inputs(shape, torch.float16, "cpu")
    n, window = shape[5], shape[6]
    assert pos[:, 0].stride(0) == 2
    out = decode_attention._op(q, k, v, pos[:, 0], n, window or 0)
    out = out.view(q.shape[0], 1, -1).float()
    errors.append((out - reference(q, k, v, pos, n, window)).abs().max().item())
print(json.dumps(errors))
"""


@pytest.mark.parametrize("block", [32, 128])
def test_kernel_matches_sdpa_in_the_interpreter(block):
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "BLOCK_S": str(block),
        "REPO": str(REPO),
        "TESTS": str(REPO / "tests"),
    }
    # fp16: the interpreter computes through numpy, which has no bf16.
    run = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(errors) == len(SHAPES)
    assert all(e < 2e-3 for e in errors), (
        errors
    )  # fp16 inputs and probabilities, fp32 sums (NaN fails)


def test_only_half_precision_single_token_cuda_queries_use_the_kernel(monkeypatch):
    def query(device="cuda", dtype=torch.bfloat16, tokens=1):
        return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 4, tokens, 8))

    monkeypatch.setattr(decode_attention, "_op", object())  # as if registered
    assert decode_attention.usable(query())
    assert decode_attention.usable(query(dtype=torch.float16))
    assert not decode_attention.usable(query(device="cpu"))
    assert not decode_attention.usable(query(dtype=torch.float32))  # fp32 releases: SDPA
    assert not decode_attention.usable(query(tokens=2))  # prefill: SDPA
    monkeypatch.setattr(decode_attention, "_op", None)
    assert not decode_attention.usable(query())  # never registered (no Triton)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_sdpa_on_the_gpu_in_bf16(shape):
    assert decode_attention.register()
    q, k, v, pos = inputs(shape, torch.bfloat16, "cuda")
    n, window = shape[5], shape[6]
    out = decode_attention.attend(q, k, v, pos, n, window).float()
    ref = reference(q, k, v, pos, n, window)
    assert (out - ref).abs().max().item() < 2e-2  # bf16 output rounding of values ~1
