"""What the planner needs from a Hugging Face checkpoint's config.json, without torch."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import CheckpointError, PipelineError, UnsupportedArchitectureError


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
    arch = _arch_name(cfg, model_type)
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
    rope = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")  # transformers 5 writes this instead
    rope = rope if isinstance(rope, dict) else {}
    params = params if isinstance(params, dict) else {}
    kind = rope.get("rope_type") or rope.get("type") or params.get("rope_type") or "default"
    if kind not in ("default", "llama3"):
        return f"uses rope type '{kind}'"
    return None


def check_neuron_exportable(checkpoint: Path) -> None:
    """Raise one line unless optimum-neuron can export this checkpoint (maybe as llama)."""
    cfg = read_config(checkpoint)
    if cfg.get("model_type") in ARCHITECTURES:
        read_shape(checkpoint)  # its sizes, checked first: _mistral_not_llama does sums on them
    neuron_export_config(cfg, str(checkpoint))


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
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            str(checkpoint), "no config.json", "point at a Hugging Face checkpoint directory"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            str(path), f"not valid JSON: {e.msg} at line {e.lineno}", None
        ) from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise CheckpointError(
            str(path), f"cannot read: {e.__class__.__name__}", "it must be a JSON text file"
        ) from None
    except RecursionError:  # json's decoder recurses once per nested [ or {
        raise CheckpointError(str(path), "not valid JSON: nested too deeply", None) from None
    if not isinstance(cfg, dict):
        raise CheckpointError(str(path), "not a JSON object", None)
    return cfg


def _arch_name(cfg: dict[str, Any], model_type: Any) -> str:
    """The architectures list for a message, whatever a broken config.json holds there."""
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs:
        return ",".join(str(a) for a in archs)
    return str(model_type)


def _whole(path: Path, cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """``cfg[key]`` as a whole number ≥ 1, or CheckpointError naming the file and key.

    ``default`` stands in for an absent or null key (Hugging Face's own rule for the optional
    num_key_value_heads and head_dim); a required key has none and raises KeyError when
    absent. Not int(): it truncates 8.5 to 8 and turns true into 1. A whole float (8.0) is
    exact, so it is taken.
    """
    value = cfg[key] if default is None else cfg.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise CheckpointError(
        f"{path}: {key}",
        f"must be a whole number ≥ 1, got {json.dumps(value)}",
        "fix the checkpoint's config.json",
    )


def _flag(path: Path, cfg: dict[str, Any], key: str, default: bool) -> bool:
    """``cfg[key]`` as a bool. Not bool(): bool("false") is True. Null or absent is
    ``default``."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    raise CheckpointError(
        f"{path}: {key}",
        f"must be true or false, got {json.dumps(value)}",
        "fix the checkpoint's config.json",
    )


def read_shape(checkpoint: Path) -> ModelShape:
    """Read ``checkpoint/config.json``; an unsupported architecture or a bad value is one line
    naming the file and key. Checked here, not left to plan_gqa: its messages name the
    ``gqa plan`` flags (``--heads``), which the user never gave when the value is the file's."""
    path = Path(checkpoint) / "config.json"
    cfg = read_config(checkpoint)
    model_type = cfg.get("model_type", "?")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            str(checkpoint),
            f"architecture {_arch_name(cfg, model_type)} (model_type '{model_type}') "
            "is not supported",
            f"supported model types: {', '.join(sorted(ARCHITECTURES))}",
        )
    try:
        q = _whole(path, cfg, "num_attention_heads")
        hidden = _whole(path, cfg, "hidden_size")
        layers = _whole(path, cfg, "num_hidden_layers")
        intermediate = _whole(path, cfg, "intermediate_size")
        vocab = _whole(path, cfg, "vocab_size")
    except KeyError as e:
        raise CheckpointError(
            str(path), f"missing key {e.args[0]}", "is this a decoder LLM?"
        ) from None
    kv = _whole(path, cfg, "num_key_value_heads", default=q)
    if q % kv:
        raise CheckpointError(
            f"{path}: num_attention_heads",
            f"{q} query heads do not divide into num_key_value_heads {kv}",
            "fix the checkpoint's config.json: query heads must be a multiple of KV heads",
        )
    if hidden < q:  # the default head_dim, hidden // q, would be 0
        raise CheckpointError(
            f"{path}: hidden_size",
            f"{hidden} is smaller than num_attention_heads {q}",
            "fix the checkpoint's config.json",
        )
    return ModelShape(
        model_type=model_type,
        hidden=hidden,
        layers=layers,
        q_heads=q,
        kv_heads=kv,
        head_dim=_whole(path, cfg, "head_dim", default=hidden // q),
        intermediate=intermediate,
        vocab=vocab,
        tied_embeddings=_flag(path, cfg, "tie_word_embeddings", False),
        qkv_bias=_flag(path, cfg, "attention_bias", ARCHITECTURES[model_type].qkv_bias),
    )


@contextlib.contextmanager
def reading_weights(path: Path) -> Iterator[None]:
    """A weights file parsed inside this: a damaged one (bad header, truncated, not a
    pickle) is one ``CheckpointError`` line naming it (exit 2), not the parser's traceback.
    Running out of memory or an I/O error while reading is the machine's failure (exit 1),
    not the file's."""
    try:
        yield
    except (PipelineError, MemoryError, OSError):
        raise
    except Exception as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if _RESOURCE_ERROR.search(why):  # safetensors reports mmap/read failures as its own
            raise PipelineError(str(path), f"cannot be read here ({why})", None) from None
        raise CheckpointError(
            str(path), f"not a readable weights file ({why})", "copy or save the checkpoint again"
        ) from None


_RESOURCE_ERROR = re.compile(r"os error \d+|allocate memory|out of memory", re.IGNORECASE)


def read_checkpoint(model_dir: Path) -> dict[str, Any]:
    """Every tensor of a Hugging Face checkpoint (safetensors, else PyTorch .bin files).
    Imports torch lazily: the planner itself never needs it."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for f in files:
        with reading_weights(f):
            state.update(load_file(str(f)))
    if files:
        return state
    files = sorted(Path(model_dir).glob("*.bin"))
    if not files:
        raise CheckpointError(str(model_dir), "no *.safetensors or *.bin weights", None)
    for f in files:
        with reading_weights(f):
            state.update(torch.load(f, weights_only=True))
    return state
