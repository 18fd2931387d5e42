"""Batch-1 products with their prologue and residual add in one Triton kernel (cuda only).

At batch 1 a decode step is a chain of matrix-vector products. Inductor fuses each
product with the RMSNorm before it, but the small ones (qkv, 12.6 MB; o, 8.4 MB for a
Llama-3.2-1B layer) ran at about 1.4 TB/s inside the step against 3.3 TB/s alone
(docs/cuda.md). Here one kernel per product does what the step needs around it:

    rms    y = W · rmsnorm(x)            (qkv from the residual stream; gate_up)
    plain  y = r + W · x                 (o, with the residual add)
    silu   y = r + W · (silu(g) ⊙ u)     (down, x = [g, u]; with the residual add)

rounded where eager bf16 rounds (the norm's output, silu, the product, the sum), so the
graph keeps to the fp32 reference as the inductor one does. Registered as a
``torch.library.triton_op``: torch.export keeps it whole, and AOTInductor compiles the
kernel into the package, so the runtime needs no Triton.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

PLAIN, RMS, SILU = 0, 1, 2

_op: Any = None


def register() -> bool:
    """Define the kernel and its op, once, outside any tracing (Dynamo cannot trace
    Triton's own start-up); False where Triton is missing."""
    try:
        _register()
    except ImportError:
        return False
    return True


def available(x: Tensor) -> bool:
    """Whether ``b1_linear`` can run on ``x``: registered, and one row on a CUDA device in
    bf16 or fp16."""
    return (
        _op is not None
        and x.device.type == "cuda"
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.numel() == x.shape[-1]
    )


def b1_linear(
    x: Tensor,
    weight: Tensor,
    *,
    prologue: int = PLAIN,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    residual: Tensor | None = None,
) -> Tensor:
    """``x`` is one row ([..., K], or [..., 2K] for ``SILU``); returns [..., N] shaped as
    ``x`` (or ``residual``) with the product's width. Needs ``register()`` first."""
    op = _op
    n = weight.shape[0]
    lead = x.shape[:-1]
    y = op(
        x.reshape(-1),
        weight,
        norm_weight if norm_weight is not None else weight,
        residual.reshape(-1) if residual is not None else weight,
        eps,
        prologue,
        residual is not None,
    )
    return y.view(*lead, n)


def _register() -> None:
    global _op
    if _op is not None:
        return
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    configs = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
        for bn in (2, 4, 8, 16)
        for bk in (256, 512, 1024)
        for w in (4, 8)
    ]

    @triton.autotune(configs=configs, key=["N", "K", "PROLOGUE"])
    @triton.jit
    def kernel(
        x_ptr,
        w_ptr,
        nw_ptr,
        r_ptr,
        y_ptr,
        N,
        K,
        eps,
        PROLOGUE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        dt = y_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rstd = 1.0
        if PROLOGUE == 1:  # the row's mean square first: x is a few KiB, read from L2
            sq = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                v = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
                sq += v * v
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            if PROLOGUE == 2:
                g = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + K + ks, mask=k_ok, other=0.0).to(tl.float32)
                s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
                v = (s * u).to(dt).to(tl.float32)
            else:
                v = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                if PROLOGUE == 1:
                    nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                    v = ((v * rstd).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
            w = tl.load(
                w_ptr + rows[:, None] * K + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += w * v[None, :]
        out = tl.sum(acc, axis=1)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            out = out.to(dt).to(tl.float32) + r
        tl.store(y_ptr + rows, out.to(dt), mask=row_ok)

    @triton_op("inf2_pipeline::b1_linear", mutates_args=())
    def op(
        x: Tensor,
        weight: Tensor,
        norm_weight: Tensor,
        residual: Tensor,
        eps: float,
        prologue: int,
        has_residual: bool,
    ) -> Tensor:
        n, k = weight.shape
        y = torch.empty(n, device=x.device, dtype=x.dtype)

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (triton.cdiv(n, meta["BLOCK_N"]),)

        wrap_triton(kernel)[grid](
            x, weight, norm_weight, residual, y, n, k, eps,
            PROLOGUE=prologue, HAS_RESIDUAL=has_residual,
        )  # fmt: skip
        return y

    _op = op
