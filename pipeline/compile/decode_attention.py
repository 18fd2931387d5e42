"""Decode attention as one Triton kernel (cuda, bf16/fp16): one query token per sequence.

In a batch-1 decode step on an H200, SDPA ran cuDNN's flash kernel, a 64×64 tile for one
query row, at 6.8 µs a layer: 0.108 ms of a 1.015 ms Llama-3.2-1B step for ~0.5 MB of
keys and values (docs/cuda.md). Here one program per (sequence, KV head) takes that head's
group of query heads together, so each key and value row is read once for the whole group
(GQA without copying the cache), and walks the attended cache positions in blocks with an
online softmax, as flash attention does. Causal and sliding-window visibility come from the
row's position, so no mask tensor is built.

Registered as a ``torch.library.triton_op``: torch.export keeps it whole and AOTInductor
compiles the kernel into the package, so the runtime needs no Triton.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

_op: Any = None


def register() -> bool:
    """Define the kernel and its op, once, outside any tracing (Dynamo cannot trace Triton's
    own start-up); False where Triton is missing."""
    try:
        _register()
    except ImportError:
        return False
    return True


def usable(q: Tensor) -> bool:
    """Whether ``attend`` can run on ``q`` ([B, H, T, D]): registered, on a CUDA device, in
    bf16 or fp16, one query token per sequence."""
    return (
        _op is not None
        and q.device.type == "cuda"
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[2] == 1
    )


def attend(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, n: Any, window: int | None) -> Tensor:
    """Softmax attention of each sequence's one query token over cache positions
    0..min(pos, n-1) (and > pos - window with a window).

    q: [B, H, 1, D]; k, v: [S, B, KV, D] one layer's cache (S ≥ n); pos: [B, 1] → [B, 1, H·D],
    the layout ``o_proj`` reads."""
    b, h, _, d = q.shape
    return _op(q, k, v, pos[:, 0], n, window or 0).view(b, 1, h * d)


def _register() -> None:
    global _op
    if _op is not None:
        return
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    configs = [
        triton.Config({"BLOCK_S": bs}, num_warps=w, num_stages=st)
        for bs in (32, 64, 128)
        for w in (2, 4)
        for st in (2, 3)
    ]

    @triton.autotune(configs=configs, key=["D", "GROUP"])
    @triton.jit
    def kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        o_ptr,
        n_keys,
        window,
        sq_b,
        sq_h,
        sp_b,
        sk_s,
        sk_b,
        sk_h,
        sv_s,
        sv_b,
        sv_h,
        KV: tl.constexpr,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        SCALE: tl.constexpr,  # a constant: a float argument may be typed fp64 when compiled
        GROUP_P: tl.constexpr,  # GROUP and D padded to what tl.dot takes
        D_P: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // KV
        kvh = pid % KV
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D_P)
        g_ok = g < GROUP
        d_ok = d < D
        heads = kvh * GROUP + g
        q = tl.load(
            q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        p = tl.load(pos_ptr + b * sp_b).to(tl.int64)
        hi = tl.minimum(n_keys, p + 1)  # positions after this token's are not visible
        lo = p * 0  # as p's type (int64), which the branch keeps
        if window > 0:
            lo = tl.maximum(p - window + 1, 0)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D_P], tl.float32)
        k_base = k_ptr + b * sk_b + kvh * sk_h
        v_base = v_ptr + b * sv_b + kvh * sv_h
        for start in range((lo // BLOCK_S) * BLOCK_S, hi, BLOCK_S):
            s = start + tl.arange(0, BLOCK_S)
            s_ok = (s >= lo) & (s < hi)
            kv_mask = s_ok[:, None] & d_ok[None, :]
            keys = tl.load(k_base + s[:, None] * sk_s + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(keys)) * SCALE  # [GROUP_P, BLOCK_S], fp32
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            probs = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(probs, axis=1)
            values = tl.load(v_base + s[:, None] * sv_s + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values)
            m = m_new
        # No visible position (only where a caller breaks the contract): 0, as SDPA gives,
        # not the NaN that would poison the row's cache.
        out = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)
        tl.store(
            o_ptr + b * (KV * GROUP * D) + heads[:, None] * D + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )

    @triton_op("inf2_pipeline::decode_attention", mutates_args=())
    def op(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, n: int, window: int) -> Tensor:
        b, h, _, d = q.shape
        kv = k.shape[2]
        if h % kv or k.stride(3) != 1 or v.stride(3) != 1:
            raise ValueError(
                f"decode_attention: {h} query heads over {kv} KV heads, or a cache "
                "whose head dimension is not contiguous"
            )
        q = q if q.stride(3) == 1 else q.contiguous()
        out = torch.empty((b, h, d), device=q.device, dtype=q.dtype)
        group = h // kv
        wrap_triton(kernel)[(b * kv,)](
            q, k, v, pos, out, n, window,
            q.stride(0), q.stride(1), pos.stride(0),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            KV=kv, GROUP=group, D=d, SCALE=1.0 / math.sqrt(d),
            GROUP_P=max(16, triton.next_power_of_2(group)),
            D_P=max(16, triton.next_power_of_2(d)),
        )  # fmt: skip
        return out

    _op = op
