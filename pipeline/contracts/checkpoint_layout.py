"""How a compiled release lays out a checkpoint's weights: Hugging Face's names, with q/k/v
and gate/up stacked into ``qkv_proj`` and ``gate_up_proj`` (one matmul each in the graphs),
and back. Compile fuses a checkpoint into that layout; parity unfuses a release's weights to
run the eager reference on exactly them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

# fused parameter -> the Hugging Face projections it stacks, in order (rows of the weight)
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_checkpoint(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A Hugging Face state dict under this decoder's names: stacked projections fused.

    Tensors are moved out of ``state`` as they are stacked, so at most one layer's
    projections exist twice at a time. A projection whose siblings are missing is left
    as it is, for the caller's name check to report."""
    import torch  # imported here: the compile backends import this module, torch or not

    out = {}
    for name in sorted(state):
        if name not in state:
            continue  # already stacked into a fused tensor
        prefix, part, leaf = _split_projection(name)
        fused = next((f for f, parts in FUSED.items() if part in parts), None)
        if fused is None:
            out[name] = state.pop(name)
            continue
        names = [f"{prefix}{p}.{leaf}" for p in FUSED[fused]]
        if any(n not in state for n in names):
            out[name] = state.pop(name)
            continue
        out[f"{prefix}{fused}.{leaf}"] = torch.cat([state.pop(n) for n in names])
    return out


def unfuse_checkpoint(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of ``fuse_checkpoint``: Hugging Face's separate projections again.

    The query rows of ``qkv_proj`` are as many as ``o_proj``'s input columns (after any GQA
    padding too); key and value share the rest equally."""
    out = {}
    for name, tensor in state.items():
        prefix, part, leaf = _split_projection(name)
        if part not in FUSED:
            out[name] = tensor
            continue
        if part == "mlp.gate_up_proj":
            sizes = [tensor.shape[0] // 2] * 2
        else:
            q = state[f"{prefix}self_attn.o_proj.weight"].shape[1]
            sizes = [q, *[(tensor.shape[0] - q) // 2] * 2]
        for sub, piece in zip(FUSED[part], tensor.split(sizes), strict=True):
            out[f"{prefix}{sub}.{leaf}"] = piece
    return out


def _split_projection(name: str) -> tuple[str, str, str]:
    # "model.layers.3.self_attn.q_proj.weight" -> ("model.layers.3.", "self_attn.q_proj", "weight")
    parts = name.split(".")
    if len(parts) < 3:
        return "", "", name
    return ".".join(parts[:-3]) + "." if len(parts) > 3 else "", ".".join(parts[-3:-1]), parts[-1]
