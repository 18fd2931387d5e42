"""What the planner needs from a Hugging Face checkpoint's config.json, without torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import CheckpointError, UnsupportedArchitectureError


@dataclass(frozen=True)
class Architecture:
    hf_prefix: str  # of its transformers classes: LlamaConfig, LlamaRotaryEmbedding, ...
    qkv_bias: bool  # q/k/v projections have biases unless config.json says otherwise


# The one list of model_type values this project plans, pads and compiles (cpu/cuda): their
# attention is q_proj/k_proj/v_proj/o_proj with a head_dim.
ARCHITECTURES = {
    "llama": Architecture("Llama", qkv_bias=False),
    "mistral": Architecture("Mistral", qkv_bias=False),
    "qwen2": Architecture("Qwen2", qkv_bias=True),
}


# optimum-neuron 0.4.5's decoders for text-generation: the registrations in
# optimum/neuron/models/inference/auto_models.py:46-127 (registry dict: models/auto_model.py:20-28).
# Its exporter takes no other model_type down the decoder path (exporters/neuron/__main__.py:751).
# tests/test_neuron_upstream.py reads the real registry, so this list cannot drift from it.
NEURON_DECODERS = (
    "granite",
    "llama",
    "llama4_text",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "smollm3",
)
NEURON_SUPPORTED = (
    f"optimum-neuron 0.4.5 exports: {', '.join(NEURON_DECODERS)}; and mistral without a "
    "sliding window, as llama"
)


def neuron_export_config(cfg: dict[str, Any], what: str) -> dict[str, Any]:
    """The config.json to hand optimum-neuron's exporter for this checkpoint config.

    A registered decoder goes as it is. Mistral is not registered in 0.4.5; without a sliding
    window it is Llama's computation (the same weights and names; MistralConfig's only extra
    key is ``sliding_window``), so it goes as a Llama config. Anything else is one line naming
    the architecture and what can be exported.
    """
    model_type = cfg.get("model_type", "?")
    arch = ",".join(cfg.get("architectures") or [model_type])
    if model_type in NEURON_DECODERS:
        return dict(cfg)
    if model_type != "mistral":
        raise UnsupportedArchitectureError(
            what,
            f"architecture {arch} (model_type '{model_type}') cannot be exported for neuron",
            NEURON_SUPPORTED,
        )
    why = _mistral_not_llama(cfg)
    if why:
        raise UnsupportedArchitectureError(
            what, f"architecture {arch} {why}, so it cannot be exported as llama", NEURON_SUPPORTED
        )
    out = {k: v for k, v in cfg.items() if k != "sliding_window"}
    out.update(model_type="llama", architectures=["LlamaForCausalLM"])
    return out


def _mistral_not_llama(cfg: dict[str, Any]) -> str | None:
    """Why this Mistral config is not Llama's computation in optimum-neuron's Llama, or None."""
    if cfg.get("sliding_window") is not None:
        return f"has a sliding window ({cfg['sliding_window']} tokens)"
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim")
    # optimum-neuron's Llama builds RoPE for hidden_size // num_attention_heads
    # (models/inference/llama/modeling_llama.py:132) while attention uses config.head_dim
    # (backend/modules/attention/attention_base.py:96-99): they must agree.
    if head_dim is not None and hidden and heads and head_dim != hidden // heads:
        return f"has head_dim {head_dim} ≠ hidden_size/heads ({hidden // heads})"
    # Other RoPE types fall back to transformers' rotary embedding (modeling_llama.py:139-155).
    rope = cfg.get("rope_scaling") or {}
    params = cfg.get("rope_parameters") or {}  # transformers 5 writes this instead
    kind = rope.get("rope_type") or rope.get("type") or params.get("rope_type") or "default"
    if kind not in ("default", "llama3"):
        return f"uses rope type '{kind}'"
    return None


def check_neuron_exportable(checkpoint: Path) -> None:
    """Raise one line unless optimum-neuron can export this checkpoint (maybe as llama)."""
    neuron_export_config(read_config(checkpoint), str(checkpoint))


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool

    def param_count(self, padded_q: int | None = None, padded_kv: int | None = None) -> int:
        """Parameters, with attention sized for padded head counts when given."""
        q = padded_q or self.q_heads
        kv = padded_kv or self.kv_heads
        d, h = self.head_dim, self.hidden
        attn = h * q * d + 2 * h * kv * d + q * d * h
        if self.qkv_bias:
            attn += q * d + 2 * kv * d
        mlp = 3 * h * self.intermediate
        per_layer = attn + mlp + 2 * h
        embed = self.vocab * h * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embed + h


def read_config(checkpoint: Path) -> dict[str, Any]:
    """``checkpoint/config.json`` as a dict; a missing or broken file is one line."""
    path = Path(checkpoint) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            str(checkpoint), "no config.json", "point at a Hugging Face checkpoint directory"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            str(path), f"not valid JSON: {e.msg} at line {e.lineno}", None
        ) from None
    if not isinstance(cfg, dict):
        raise CheckpointError(str(path), "not a JSON object", None)
    return cfg


def read_shape(checkpoint: Path) -> ModelShape:
    """Read ``checkpoint/config.json``; unsupported architectures get a clear error."""
    path = Path(checkpoint) / "config.json"
    cfg = read_config(checkpoint)
    model_type = cfg.get("model_type", "?")
    if model_type not in ARCHITECTURES:
        arch = ",".join(cfg.get("architectures") or [model_type])
        raise UnsupportedArchitectureError(
            str(checkpoint),
            f"architecture {arch} (model_type '{model_type}') is not supported",
            f"supported model types: {', '.join(sorted(ARCHITECTURES))}",
        )
    try:
        q = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelShape(
            model_type=model_type,
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            q_heads=q,
            kv_heads=int(cfg.get("num_key_value_heads") or q),
            head_dim=int(cfg.get("head_dim") or hidden // q),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", ARCHITECTURES[model_type].qkv_bias)),
        )
    except KeyError as e:
        raise CheckpointError(
            str(path), f"missing key {e.args[0]}", "is this a decoder LLM?"
        ) from None


def read_checkpoint(model_dir: Path) -> dict[str, Any]:
    """Every tensor of a Hugging Face checkpoint (safetensors, else PyTorch .bin files).
    Imports torch lazily: the planner itself never needs it."""
    import torch
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    files = sorted(Path(model_dir).glob("*.bin"))
    if not files:
        raise CheckpointError(str(model_dir), "no *.safetensors or *.bin weights", None)
    return {k: v for f in files for k, v in torch.load(f, weights_only=True).items()}
