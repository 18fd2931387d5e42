"""A small, deterministic, random-weight decoder checkpoint for demos and tests.

No model hub is needed: the same arguments always give the same bytes (for one torch
version), and ``transformers.AutoModelForCausalLM`` loads the result.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from pipeline.errors import InputError
from pipeline.plan.checkpoint import ARCHITECTURES


def write_tiny_model(
    out: Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 8,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int | None = None,
    max_positions: int = 4096,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write config.json, model.safetensors and generation_config.json into ``out``."""
    for name, v in (
        ("layers", layers),
        ("hidden", hidden),
        ("heads", heads),
        ("kv-heads", kv_heads),
        ("vocab", vocab),
    ):
        if v < 1:
            raise InputError(f"--{name}", f"must be ≥ 1, got {v}", None)
    if hidden % heads:
        raise InputError(
            "--hidden",
            f"{hidden} is not divisible by {heads} heads",
            "pick hidden = heads × head_dim",
        )
    if arch not in ARCHITECTURES:
        raise InputError(
            "--arch", f"unknown architecture '{arch}'", f"use {', '.join(ARCHITECTURES)}"
        )
    if heads % kv_heads:
        raise InputError(
            "--kv-heads", f"{heads} query heads are not a multiple of {kv_heads}", None
        )
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InputError(
            str(out), "directory exists and is not empty", "pass --overwrite or another DIR"
        )

    import torch
    import transformers

    cls = getattr(transformers, f"{ARCHITECTURES[arch].hf_prefix}Config")
    config = cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        # A wide init keeps logits well separated, so greedy tokens are robust to fp noise.
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.generation_config.do_sample = False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".incomplete", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
