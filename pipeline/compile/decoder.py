"""A small decoder (Llama, Mistral, Qwen2) written for ``torch.export``, gpt-fast style.

Why not the Hugging Face module: its caches are module buffers, so a prefill graph and a
decode graph compiled separately could not share one cache. Here the caches are explicit
inputs that both graphs update in place (see ``pipeline.contracts.graph_abi``).

Parameter names are Hugging Face's (``model.layers.0.self_attn.o_proj.weight`` ...), except
that the projections that read the same input are fused, as vLLM and gpt-fast do: q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``. At batch 1 decode reads every weight once per
token, and one wide matrix-vector product streams its weights closer to the memory bandwidth
than three narrow ones (on an H200, fusing took a Llama-3.2-1B decode step from 1.22 ms to
1.14 ms). ``pipeline.contracts.checkpoint_layout.fuse_checkpoint`` maps a Hugging Face state dict
onto these names. Rotary
frequencies come from transformers' own rotary module, so every ``rope_scaling`` variant it
knows (llama3, yarn, linear) matches exactly.

Shapes: B batch, S bucket sequence length (= cache length), T tokens in this call (S for
prefill, 1 for decode), L layers, H query heads, KV key/value heads, D head dim.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.compile import decode_attention
from pipeline.compile.argmax import greedy
from pipeline.contracts.checkpoint_layout import fuse_checkpoint
from pipeline.errors import UnsupportedArchitectureError
from pipeline.plan.checkpoint import ARCHITECTURES


class Caches(NamedTuple):
    """What one layer's attention needs of the caches: both whole (written in place with one
    index_put each, see ``write_cache``), its layer, the cache rows (slots) this call's
    sequences live in, and the positions it reads.

    ``keys`` None: a prefill, which starts its slot from position 0, so it attends only the
    keys and values it computes itself and reads nothing back from the cache."""

    k: Tensor  # [L, S, B, KV, D]
    v: Tensor
    layer: int
    rows: Tensor  # [N] the cache row of each sequence of this call ([N, T]: of each position)
    keys: Tensor | None  # [S'] cache positions attended, 0..S'-1; None for a prefill
    # [N, T] for a packed prefill (``Mixed``): each position attends only its own segment
    segment: Tensor | None = None


class Part(NamedTuple):
    """One part of a ``Mixed`` call: N sequences of T positions, their rotary tables and
    positions, and their caches (``layer`` filled in per layer)."""

    n: Any  # int, or a symbolic size while exporting
    t: int
    cos: Tensor  # [N, T, D]
    sin: Tensor
    pos: Tensor  # [N, T]
    caches: Caches


# Rope types whose frequencies change with the sequence length at run time.
DYNAMIC_ROPE = {"dynamic", "longrope"}

# Decode on cuda in half precision attends with decode_attention's Triton kernel instead
# of SDPA (read while tracing; bench/profile_cuda_decode.py compares both).
DECODE_ATTENTION_KERNEL = True


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
        self.split = (self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=qkv_bias(cfg))
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, caches: Caches) -> Tensor:
        # x: [B, T, hidden]; cos/sin: [B, T, D]; pos: [B, T]
        return self.o_proj(self.attend(*self.project(x), cos, sin, pos, caches))

    def project(self, x: Tensor) -> tuple[Tensor, ...]:
        """q, k, v of every position of ``x`` [..., hidden], in one matrix product."""
        return self.qkv_proj(x).split(self.split, dim=-1)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, caches: Caches
    ) -> Tensor:
        """One part's attention: q/k/v [N, T, heads·D] of N sequences of T positions, rotated,
        written into their cache rows, attended -> [N, T, heads·D]."""
        b, t = q.shape[:2]
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache, v_cache, layer, rows, keys, segment = caches
        write_cache(k_cache, layer, k, pos, rows)
        write_cache(v_cache, layer, v, pos, rows)
        if keys is None:  # prefill: the whole context is k and v themselves
            y = attend(q, k, v, pos, pos, self.window, segment)
        elif DECODE_ATTENTION_KERNEL and decode_attention.usable(q):
            n = keys.shape[0]
            y = decode_attention.attend(q, k_cache[layer], v_cache[layer], pos, n, self.window)
        else:
            n = keys.shape[0]
            k_seen = k_cache[layer][:n].permute(1, 2, 0, 3)  # [B, KV, S', D]
            v_seen = v_cache[layer][:n].permute(1, 2, 0, 3)
            y = attend(q, k_seen, v_seen, pos, keys[None], self.window)
        if y.dim() == 4:
            y = y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return y


class MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, cfg: Any, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, caches: Caches):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, caches)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_parts(self, x: Tensor, parts: list[Part], layer: int) -> Tensor:
        """``forward`` over several parts at once (``Mixed``): x [Σ N·T, hidden] holds each
        part's positions in turn; the projections and the MLP take them all in one matrix
        product each (one pass over the weights), attention runs part by part, in order."""
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(x))
        ys, at = [], 0
        for n, t, cos, sin, pos, caches in parts:
            span = slice(at, at + n * t)
            ys.append(
                attn.attend(
                    q[span].view(n, t, -1),
                    k[span].view(n, t, -1),
                    v[span].view(n, t, -1),
                    cos,
                    sin,
                    pos,
                    caches._replace(layer=layer),
                ).reshape(n * t, -1)
            )
            at += n * t
        x = x + attn.o_proj(torch.cat(ys))
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

    def hidden(
        self,
        tokens: Tensor,
        pos: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        rows: Tensor,
        keys: Tensor | None,
    ) -> Tensor:
        # tokens, pos: [N, T]; caches: [L, S, B, KV, D], updated in place; rows: [N] the cache
        # row of each sequence; keys: [S'] the cache positions attention reads, 0..S'-1
        # (S' ≤ S), or None for a prefill from position 0
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rotary(pos, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, pos, Caches(k_cache, v_cache, i, rows, keys))
        return x

    def rotary(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [..., D] at positions ``pos`` [...]."""
        freqs = pos[..., None].float() * self.rope_inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(hidden)).float()


class Prefill(Decoder):
    """Prefill graph: P right-padded prompts of T tokens fill cache rows ``slots`` from
    position 0 (positions 0..T-1 of each; the other rows are untouched); per prompt, the
    logits of its last real token and the greedy next token.

    A request joins a running bucket without disturbing its other rows. T is one of the
    bucket's prefill lengths, so a short prompt in a long bucket pays for its own length,
    not the bucket's; P (1..B, a dynamic size where export allows) lets the requests that
    arrive together share one call."""

    def forward(
        self, tokens: Tensor, lengths: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor
    ):
        # tokens: [P, T]; lengths: [P] real tokens (1..T); slots: [P] distinct cache rows
        p, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).expand(p, t)
        hidden = self.hidden(tokens, pos, k_cache, v_cache, slots, None)
        last = hidden[torch.arange(p, device=tokens.device), lengths - 1]  # [P, hidden]
        return greedy(self.logits(last))


class Decode(Decoder):
    """Decode graph: one new token per sequence at its position; that token's logits and the
    greedy next token.

    ``key_positions`` ([S'], 0..S'-1, S' > every position) bounds what attention reads: the
    first S' cache positions, not the whole bucket. Its length is a dynamic dimension of the
    compiled graph, so one package serves every filled length (``graph_abi.key_tiers``)."""

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        key_positions: Tensor,
    ):
        # tokens: [B, 1]; positions: [B], where this token goes in the cache (a row not in
        # use is stepped too, at any position < S: its output is ignored)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        hidden = self.hidden(tokens, positions[:, None], k_cache, v_cache, rows, key_positions)
        return greedy(self.logits(hidden[:, 0]))


class Mixed(Decoder):
    """Mixed graph: ``Decode``'s step of every row and P prompts packed end to end into one
    stream of T tokens, in one call, so the prompts ride in the step's pass over the weights.

    On a GPU a small prefill call costs about what a step costs, a pass over the weights
    whatever its few positions (bench/RESULTS.md, eighteenth round: 60 % of the current
    replay's device time was prefill calls of ~70-token prompts). Here the projections and
    the MLP take the B step rows and the T stream positions in one matrix product each, as
    vLLM's chunked prefill and Sarathi's piggybacking do, and attention runs per part: the
    step over its rows' cache prefix (``key_positions``), the stream causally within each
    prompt (a block-diagonal mask). Packed, a prompt costs its own positions: padded to a
    common prefill length (graph ABI 5), 55 % of a folded call's positions were padding on
    the current replay (bench/RESULTS.md, twenty-third round).

    The stream holds the prompts in order, then padding up to T. A prompt of length 0 is a
    placeholder (a recorded call's unused prompt): it owns no position and repeats the
    previous prompt's output. Padding positions go to the shortest prompt's row after its
    own positions (junk that its first decode step overwrites before it reads it, as a
    padded prefill's), and attend only padding, so they stay finite. The prompts fill rows
    the step does not use; the step's writes come first (a free row's step writes at its
    held position, which its prompt then overwrites)."""

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        prompt_tokens: Tensor,
        prompt_lengths: Tensor,
        prompt_slots: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        key_positions: Tensor,
    ):
        # tokens [B, 1], positions [B]: decode's; prompt_tokens [T] the packed stream,
        # prompt_lengths [P] (0: a placeholder), prompt_slots [P] the rows they fill
        b = tokens.shape[0]
        t = prompt_tokens.shape[0]
        dev = tokens.device
        pos, rows, segment, last = packed_layout(prompt_lengths, prompt_slots, t, k_cache.shape[1])
        flat = torch.cat((tokens.reshape(b), prompt_tokens))
        x = self.model.embed_tokens(flat)
        step_pos = positions[:, None]
        step_cos, step_sin = self.rotary(step_pos, x.dtype)
        prompt_cos, prompt_sin = self.rotary(pos[None], x.dtype)
        step = Caches(k_cache, v_cache, 0, torch.arange(b, device=dev), key_positions)
        stream = Caches(k_cache, v_cache, 0, rows[None], None, segment[None])
        parts = [
            Part(b, 1, step_cos, step_sin, step_pos, step),
            Part(1, t, prompt_cos, prompt_sin, pos[None], stream),
        ]
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_parts(x, parts, i)
        return greedy(self.logits(torch.cat((x[:b], x[b:][last]))))


def packed_layout(
    lengths: Tensor, slots: Tensor, t: int, seq: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Where each of a packed stream's ``t`` positions goes (``Mixed``): its position in its
    prompt, its cache row, its segment (its prompt's index; padding P) and, per prompt, the
    stream index of its last token. ``lengths`` [P] may hold 0s (placeholders)."""
    p, ends = lengths.shape[0], lengths.cumsum(0)  # ends: [P]
    at = torch.arange(t, device=lengths.device)
    # the prompt each position falls in: how many prompts end at or before it (P: padding)
    segment = (at[:, None] >= ends[None, :]).sum(1)
    own = segment.clamp(max=p - 1)
    real = segment < p
    # padding: past the shortest prompt, in its row, within the cache (no indexing by a 0-d
    # tensor: export reads one back as a number, which cuda's export could not specialise)
    real_lengths = torch.where(lengths > 0, lengths, seq + 1)
    shortest = real_lengths.argmin(0, keepdim=True)
    pad_pos = (real_lengths.amin(0, keepdim=True) + at - lengths.sum()).clamp(max=seq - 1)
    pos = torch.where(real, at - (ends - lengths)[own], pad_pos)
    rows = torch.where(real, slots[own], slots.gather(0, shortest))
    last = (ends - 1).clamp(min=0)
    return pos, rows, segment, last


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, heads, T, D]; cos/sin: [B, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def write_cache(cache: Tensor, layer: int, new: Tensor, pos: Tensor, rows: Tensor) -> None:
    """Write ``new`` at ``pos`` of cache rows ``rows`` (one per sequence, or one per
    position) into layer ``layer`` of ``cache``, in place.

    One index_put on the whole [L, S, B, KV, D] cache, not a scatter into the layer's view:
    compiled, a write through a view of a graph input became a copy of the whole cache per
    layer and step (on an H200 at batch 32, 1.5 ms of a 2.9 ms Llama-3.2-1B decode step;
    bench/profile_cuda_decode.py), while an index_put on the input itself stays in place."""
    # cache: [L, S, B, KV, D]; new: [N, KV, T, D]; pos: [N, T]; rows: [N] or [N, T]
    kv = new.shape[1]
    at = torch.full((1, 1, 1), layer, dtype=torch.long, device=pos.device)
    heads = torch.arange(kv, device=pos.device)[None, :, None]
    where = rows[:, None, :] if rows.dim() == 2 else rows[:, None, None]
    cache.index_put_((at, pos[:, None, :], where, heads), new)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    keys: Tensor,
    window: int | None,
    segment: Tensor | None = None,
) -> Tensor:
    # q: [B, H, T, D]; k, v: [B, KV, S', D]; pos: [B, T] the queries' positions; keys: [B, S']
    # (or [1, S']) the keys' positions -> [B, H, T, D]; segment [B, T] (queries and keys are
    # the same positions then): a packed prefill, each position sees only its own segment
    # Decode passes the first S' cache positions: its cost follows the filled length, not
    # the bucket's. The cache is position-major so that this prefix is a dense block for any
    # S' (a slice of an inner dimension would make export specialise S' to the bucket
    # length). One fused attention kernel; enable_gqa maps query head j to KV head j // (H/KV)
    # without copying the cache (measured faster than folding the heads into the query
    # length, by hand or through SDPA: bench/profile_cuda_decode.py).
    keys = keys[:, None, :]  # [B, 1, S']
    visible = keys <= pos[..., None]  # causal: [B, T, S']
    if window is not None:
        visible = visible & (keys > pos[..., None] - window)
    if segment is not None:
        visible = visible & (segment[:, None, :] == segment[..., None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=True)


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
        rotary = getattr(module, f"{ARCHITECTURES[cfg.model_type].hf_prefix}RotaryEmbedding")(cfg)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


def check_supported(cfg: Any) -> None:
    where = getattr(cfg, "_name_or_path", "") or "config.json"
    if cfg.model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            where,
            f"model_type '{cfg.model_type}' cannot be compiled by the cpu/cuda backends",
            f"supported: {', '.join(sorted(ARCHITECTURES))}",
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
    """A ``graph`` (Prefill, Decode, Mixed) with uninitialised weights: enough to export, and no
    weights are read.

    The compiled packages keep weights out (``package_constants_in_so=False``), so export
    and compile only need shapes; the memory is allocated but never touched.
    """
    if DECODE_ATTENTION_KERNEL and torch.device(device).type == "cuda":
        decode_attention.register()
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

    from pipeline.plan.checkpoint import read_checkpoint

    cfg = AutoConfig.from_pretrained(model_dir)
    decoder = build(cfg, dtype, "cpu", graph)
    state = {k: v for k, v in read_checkpoint(model_dir).items() if "rotary_emb" not in k}
    result = decoder.load_state_dict(fuse_checkpoint(state), strict=False)
    missing = set(result.missing_keys) - set(aliases(decoder)) - {"rope_inv_freq"}
    if missing or result.unexpected_keys:
        raise ValueError(f"weights do not fit: missing {missing}, extra {result.unexpected_keys}")
    return decoder
