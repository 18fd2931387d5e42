"""A small decoder (Llama, Mistral, Qwen2) written for ``torch.export``, gpt-fast style.

Why not the Hugging Face module: its caches are module buffers, so a prefill graph and a
decode graph compiled separately could not share one cache. Here the caches are explicit
inputs that both graphs update in place (see ``pipeline.graph_abi``).

Parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so a
checkpoint's safetensors load with ``load_state_dict(strict=True)``. Rotary frequencies come
from transformers' own rotary module, so every ``rope_scaling`` variant it knows (llama3,
yarn, linear) matches exactly.

Shapes: B batch, S bucket sequence length (= cache length), T tokens in this call (S for
prefill, 1 for decode), L layers, H query heads, KV key/value heads, D head dim.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import UnsupportedArchitectureError

# model_type -> the prefix of its transformers classes (for the rotary module).
ARCHS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
# Rope types whose frequencies change with the sequence length at run time.
DYNAMIC_ROPE = {"dynamic", "longrope"}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # In fp32, then back, as Hugging Face does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Any, window: int | None) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        self.window = window
        bias = qkv_bias(cfg)
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        # x: [B, T, hidden]; cos/sin: [B, T, D]; pos: [B, T]; caches: [B, KV, S, D]
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        write_cache(k_cache, k, pos)
        write_cache(v_cache, v, pos)
        y = attend(q, k_cache, v_cache, pos, self.window)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: Any, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, kc: Tensor, vc: Tensor):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, kc, vc)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        windows = sliding_windows(cfg)
        self.layers = nn.ModuleList(Layer(cfg, w) for w in windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """The model; ``Prefill`` and ``Decode`` below add the two graphs' entry points.

    Subclasses rather than wrappers, so exported constants keep Hugging Face's names.
    """

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        check_supported(cfg)
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.rope_scale = rope_frequencies(cfg)
        self.register_buffer("rope_inv_freq", inv_freq)

    def hidden(self, tokens: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        # tokens, pos: [B, T]; caches: [L, B, KV, S, D], updated in place
        x = self.model.embed_tokens(tokens)
        freqs = pos[..., None].float() * self.rope_inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)
        sin = (emb.sin() * self.rope_scale).to(x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, pos, k_cache[i], v_cache[i])
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(hidden)).float()


class Prefill(Decoder):
    """Prefill graph: right-padded prompts fill the cache; logits of each last real token."""

    def forward(self, tokens: Tensor, lengths: Tensor, k_cache: Tensor, v_cache: Tensor):
        # tokens: [B, S]; lengths: [B] real tokens per row (≥ 1)
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).expand(b, s)
        hidden = self.hidden(tokens, pos, k_cache, v_cache)
        last = hidden[torch.arange(b, device=tokens.device), lengths - 1]  # [B, hidden]
        return self.logits(last)


class Decode(Decoder):
    """Decode graph: one new token per sequence at its position; logits of that token."""

    def forward(self, tokens: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor):
        # tokens: [B, 1]; positions: [B], where this token goes in the cache
        hidden = self.hidden(tokens, positions[:, None], k_cache, v_cache)
        return self.logits(hidden[:, 0])


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, heads, T, D]; cos/sin: [B, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def write_cache(cache: Tensor, new: Tensor, pos: Tensor) -> None:
    # cache: [B, KV, S, D]; new: [B, KV, T, D]; pos: [B, T]
    b, kv, t, d = new.shape
    index = pos[:, None, :, None].expand(b, kv, t, d)
    cache.scatter_(2, index, new)


def attend(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, window: int | None) -> Tensor:
    # q: [B, H, T, D]; k, v: [B, KV, S, D]; pos: [B, T] -> [B, H, T, D]
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    # Query head j uses KV head j // (H/KV): group queries per KV head, no copy of the cache.
    q = q.reshape(b, kv, (h // kv) * t, d)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5  # [B, KV, (H/KV)·T, S]
    key_pos = torch.arange(s, device=q.device)
    visible = key_pos <= pos[..., None]  # causal: [B, T, S]
    if window is not None:
        visible = visible & (key_pos > pos[..., None] - window)
    visible = visible[:, None, None].expand(b, kv, h // kv, t, s).reshape(b, kv, -1, s)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).reshape(b, h, t, d)


def head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def qkv_bias(cfg: Any) -> bool:
    return bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2"))


def sliding_windows(cfg: Any) -> list[int | None]:
    """Per layer: the sliding attention window, or None for full attention."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False):
        window = None
    if window is None:
        return [None] * cfg.num_hidden_layers
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * cfg.num_hidden_layers


def rope_frequencies(cfg: Any) -> tuple[Tensor, float]:
    """(inv_freq [D/2], attention scaling) exactly as the model's transformers module computes."""
    module = importlib.import_module(
        f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}"
    )
    with torch.device("cpu"):  # real numbers even when the decoder is built on "meta"
        rotary = getattr(module, f"{ARCHS[cfg.model_type]}RotaryEmbedding")(cfg)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


def check_supported(cfg: Any) -> None:
    where = getattr(cfg, "_name_or_path", "") or "config.json"
    if cfg.model_type not in ARCHS:
        raise UnsupportedArchitectureError(
            where,
            f"model_type '{cfg.model_type}' cannot be compiled by the cpu/cuda backends",
            f"supported: {', '.join(sorted(ARCHS))}",
        )
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in DYNAMIC_ROPE:
        raise UnsupportedArchitectureError(
            where,
            f"rope type '{rope_type}' changes with the sequence length, static graphs cannot",
            "use a checkpoint with default, linear, llama3 or yarn rope scaling",
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(
            where, f"activation '{cfg.hidden_act}' is not supported", "only silu (SwiGLU)"
        )


def build(cfg: Any, dtype: torch.dtype, device: str | torch.device, graph: type = Decoder):
    """A ``graph`` (Prefill, Decode) with uninitialised weights: enough to export, and no
    weights are read.

    The compiled packages keep weights out (``package_constants_in_so=False``), so export
    and compile only need shapes; the memory is allocated but never touched.
    """
    with torch.device("meta"):
        decoder = graph(cfg).to(dtype)
    decoder = decoder.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each name its own tensor: tie again
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    decoder.rope_inv_freq = rope_frequencies(cfg)[0].to(device)  # fp32, like Hugging Face
    return decoder.eval()


def aliases(decoder: Decoder) -> dict[str, str]:
    """Parameter names that share a tensor with an earlier one (tied embeddings) → that one."""
    first: dict[int, str] = {}
    out = {}
    for name, p in decoder.named_parameters(remove_duplicate=False):
        out.update({name: first[id(p)]} if id(p) in first else {})
        first.setdefault(id(p), name)
    return out


def from_checkpoint(model_dir: Any, graph: type = Decoder, dtype: torch.dtype = torch.float32):
    """An eager ``graph`` with the checkpoint's weights (for parity checks and debugging)."""
    from transformers import AutoConfig

    from pipeline.compile.backends.aoti import read_checkpoint

    cfg = AutoConfig.from_pretrained(model_dir)
    decoder = build(cfg, dtype, "cpu", graph)
    state = {k: v for k, v in read_checkpoint(model_dir).items() if "rotary_emb" not in k}
    result = decoder.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - set(aliases(decoder)) - {"rope_inv_freq"}
    if missing or result.unexpected_keys:
        raise ValueError(f"weights do not fit: missing {missing}, extra {result.unexpected_keys}")
    return decoder
