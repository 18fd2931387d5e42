"""Apply a GQA head-padding plan to a Hugging Face checkpoint, tensor by tensor.

The plan (pipeline/gqa.py) says which original head each padded slot holds. Here the
weights follow it, so that every tensor-parallel rank holds whole heads and the model
computes exactly what it computed before:

* ``q_proj`` rows (and bias) by ``q_slot_sources``: zero rows for padded query heads;
* ``k_proj``/``v_proj`` rows (and biases) by ``kv_slot_sources``: replicated KV heads sit
  next to each other (repeat-interleave);
* ``o_proj`` input columns by ``q_slot_sources``: zero columns for padded query heads. A zero
  query attends uniformly and returns the mean of V, so without zero columns it would leak
  into the output.

Weights stream through safetensors: each output shard is filled from memory-mapped inputs,
written, and dropped, so peak memory stays near one shard plus one tensor, not the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.errors import CheckpointError, InputError, UnsupportedArchitectureError
from pipeline.plan.checkpoint import ModelShape, read_shape, reading_weights
from pipeline.plan.config import DTYPE_BYTES
from pipeline.plan.gqa import GqaPlan, plan_gqa

if TYPE_CHECKING:
    import torch

CONFIG_KEY = "inf2_pipeline_gqa"  # the plan, recorded in the padded config.json
STRATEGIES = ("auto", "replicate_to_tp_degree", "convert_to_mha")
DEFAULT_SHARD_BYTES = 2 * 1024**3
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Top-level files that are not carried over: weights are rewritten, config.json is rewritten.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_SKIP_FILES = {"config.json", INDEX_NAME, "pytorch_model.bin.index.json"}

_ATTN = re.compile(r"\.self_attn\.([qkvo])_proj\.(\w+)$")


@dataclass(frozen=True)
class _Rule:
    """How one attention tensor is rewritten: which slot map, along which dimension."""

    sources: Literal["q", "kv"]
    dim: int


def _rule(name: str) -> _Rule | None:
    m = _ATTN.search(name)
    if not m:
        return None
    proj, kind = m.groups()
    if kind not in ("weight", "bias"):
        raise CheckpointError(
            name,
            f"attention tensor kind '{kind}' cannot be padded",
            "quantized checkpoints are not supported; pad the full-precision weights",
        )
    if proj == "o":
        # o_proj's bias is on its output (hidden) side: unchanged.
        return _Rule("q", 1) if kind == "weight" else None
    return _Rule("q" if proj == "q" else "kv", 0)


def _sources(rule: _Rule, plan: GqaPlan) -> list[int | None]:
    return plan.q_slot_sources() if rule.sources == "q" else plan.kv_slot_sources()


def _original_heads(rule: _Rule, plan: GqaPlan) -> int:
    return plan.q_heads if rule.sources == "q" else plan.kv_heads


def padded_shape(name: str, shape: tuple[int, ...], model: ModelShape, plan: GqaPlan) -> tuple:
    """The shape ``name`` has after padding (checked against the model's head counts)."""
    rule = _rule(name)
    if rule is None:
        return tuple(shape)
    want = _original_heads(rule, plan) * model.head_dim
    if len(shape) <= rule.dim or shape[rule.dim] != want:
        raise CheckpointError(
            name,
            f"shape {list(shape)} does not hold {_original_heads(rule, plan)} heads of "
            f"{model.head_dim} along dim {rule.dim}",
            "config.json and the weights disagree",
        )
    out = list(shape)
    out[rule.dim] = len(_sources(rule, plan)) * model.head_dim
    return tuple(out)


def pad_tensor(name: str, tensor: torch.Tensor, shape: ModelShape, plan: GqaPlan) -> torch.Tensor:
    """Rewrite one checkpoint tensor for ``plan``; tensors outside attention pass through."""
    rule = _rule(name)
    if rule is None:
        return tensor
    out = tensor.new_zeros(padded_shape(name, tuple(tensor.shape), shape, plan))
    d = shape.head_dim
    for slot, head in enumerate(_sources(rule, plan)):
        if head is not None:  # pad slots stay zero
            out.narrow(rule.dim, slot * d, d).copy_(tensor.narrow(rule.dim, head * d, d))
    return out


def padded_config(config: dict, shape: ModelShape, plan: GqaPlan) -> dict:
    """config.json for the padded model: new head counts, explicit head_dim, the plan."""
    out = dict(config)
    out["num_attention_heads"] = plan.padded_q_heads
    out["num_key_value_heads"] = plan.padded_kv_heads
    # hidden_size no longer equals heads × head_dim, so head_dim must be spelled out.
    out["head_dim"] = shape.head_dim
    out[CONFIG_KEY] = {**plan.to_dict(), "source_model_type": shape.model_type}
    if shape.model_type == "llama" and int(config["hidden_size"]) % plan.padded_q_heads:
        _llama_as_mistral(out, shape)
    return out


def _llama_as_mistral(config: dict, shape: ModelShape) -> None:
    """Relabel a padded Llama as Mistral, which transformers can load.

    transformers' LlamaConfig rejects hidden_size % num_attention_heads != 0 even with an
    explicit head_dim (huggingface/transformers#46082), though LlamaAttention handles it.
    Mistral is the same network without Llama's optional biases, plus a sliding window
    that we turn off, and its config has no such check.
    """
    if shape.qkv_bias or config.get("mlp_bias"):
        raise UnsupportedArchitectureError(
            f"llama with {config['num_attention_heads']} padded heads",
            f"hidden_size {config['hidden_size']} is not a multiple of the padded head count, "
            "which transformers' LlamaConfig rejects, and the model's biases rule out loading "
            "it as Mistral",
            "pick a tp whose padded head count divides hidden_size",
        )
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
        config.pop(key, None)
    config["model_type"] = "mistral"
    config["architectures"] = ["MistralForCausalLM"]
    config["sliding_window"] = None


def plan_for_checkpoint(src: Path, tp: int, strategy: str = "auto") -> tuple[ModelShape, GqaPlan]:
    """Read the checkpoint's shape (unsupported architectures raise) and plan its padding."""
    if strategy not in STRATEGIES:
        raise InputError(
            "--strategy", f"unknown strategy '{strategy}'", f"use {', '.join(STRATEGIES)}"
        )
    shape = read_shape(Path(src))
    cfg = json.loads((Path(src) / "config.json").read_text())
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
    plan = plan_gqa(
        shape.q_heads,
        shape.kv_heads,
        tp,
        strategy,  # type: ignore[arg-type]
        head_dim=shape.head_dim,
        layers=shape.layers,
        dtype_bytes=DTYPE_BYTES.get(dtype),
    )
    return shape, plan


def _input_files(src: Path) -> list[Path]:
    index = src / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(str(index), f"not a safetensors index ({e})", None) from None
        files = [src / f for f in dict.fromkeys(weight_map.values())]
    elif (src / SINGLE_NAME).is_file():
        files = [src / SINGLE_NAME]
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        has_bin = any(src.glob("*.bin"))
        raise CheckpointError(
            str(src),
            "no safetensors weights" + (" (only .bin files)" if has_bin else ""),
            "save the model with safe_serialization=True",
        )
    for f in files:
        if not f.is_file():
            raise CheckpointError(str(f), "listed in the index but missing", None)
    return files


def _tensor_names(
    files: list[Path], shape: ModelShape, plan: GqaPlan
) -> tuple[list[tuple[Path, str]], dict[str, str]]:
    """Every (file, tensor name) in order and the file metadata; checks shapes from headers,
    so a checkpoint that disagrees with its config fails before anything is written."""
    from safetensors import safe_open

    names: list[tuple[Path, str]] = []
    metadata: dict[str, str] = {}
    for f in files:
        with reading_weights(f), safe_open(f, framework="pt") as sf:
            metadata = metadata or dict(sf.metadata() or {})
            keys = sf.keys()
            for name in keys:
                padded_shape(name, tuple(sf.get_slice(name).get_shape()), shape, plan)
                names.append((f, name))
    metadata.setdefault("format", "pt")  # transformers refuses files without it
    return names, metadata


def _write_weights(
    files: list[Path], tmp: Path, shape: ModelShape, plan: GqaPlan, max_shard_bytes: int
) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    names, metadata = _tensor_names(files, shape, plan)
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    inputs = ExitStack()
    opened: dict[Path, object] = {}

    def flush() -> None:
        nonlocal shard, size
        save_file(shard, tmp / f"part-{len(shards):05d}", metadata=metadata)
        shards.append(list(shard))
        shard, size = {}, 0
        # Reopening the inputs per output shard releases the pages mapped for the last one,
        # so resident memory follows the shard, not the whole input file.
        inputs.close()
        opened.clear()

    try:
        for f, name in names:
            with reading_weights(f):
                if f not in opened:
                    opened[f] = inputs.enter_context(safe_open(f, framework="pt"))
                t = opened[f].get_tensor(name)  # type: ignore[attr-defined]
            t = pad_tensor(name, t, shape, plan)
            if shard and size + t.nbytes > max_shard_bytes:
                flush()
            shard[name] = t
            size += t.nbytes
            total += t.nbytes
        flush()
    finally:
        inputs.close()
    n = len(shards)
    if n == 1:
        (tmp / "part-00000").rename(tmp / SINGLE_NAME)
        return
    weight_map = {}
    for i, tensor_names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (tmp / f"part-{i:05d}").rename(tmp / fname)
        weight_map.update(dict.fromkeys(tensor_names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _copy_extras(src: Path, tmp: Path) -> None:
    """Carry over generation_config.json, tokenizer files, license and the like."""
    for f in sorted(src.iterdir()):
        if (
            f.is_file()
            and not f.name.startswith(".")
            and f.name not in _SKIP_FILES
            and not f.name.endswith(_WEIGHT_SUFFIXES)
        ):
            shutil.copy2(f, tmp / f.name)


def _fsync_files(directory: Path) -> None:
    """Flush every file to disk before the rename makes the directory visible."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def pad_checkpoint(
    src: Path,
    out: Path,
    tp: int,
    strategy: str = "auto",
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> GqaPlan:
    """Write a copy of checkpoint ``src`` to ``out`` with attention heads padded for ``tp``.

    ``out`` appears complete or not at all: it is written under a temporary name beside it
    and renamed at the end. ``transformers.AutoModelForCausalLM`` loads the result, which
    computes the same logits as ``src``; its config.json records the plan under
    ``"inf2_pipeline_gqa"``.
    """
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise CheckpointError(str(src), "not a directory", "point at a Hugging Face checkpoint")
    shape, plan = plan_for_checkpoint(src, tp, strategy)
    source = json.loads((src / "config.json").read_text())
    if CONFIG_KEY in source:
        raise InputError(
            str(src),
            f"is already padded (for tp {source[CONFIG_KEY].get('tp')})",
            "pad the original checkpoint",
        )
    if out.resolve() == src.resolve():
        raise InputError(str(out), "is the source checkpoint", "write to another directory")
    if out.exists() and not out.is_dir():
        raise InputError(str(out), "exists and is not a directory", "choose another OUT_DIR")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InputError(str(out), "already exists", "pass --overwrite or another OUT_DIR")
    files = _input_files(src)
    config = padded_config(source, shape, plan)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".incomplete", dir=out.parent))
    old = None
    try:
        _write_weights(files, tmp, shape, plan, max_shard_bytes)
        _copy_extras(src, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _fsync_files(tmp)
        if out.exists():
            # A directory cannot be renamed over a non-empty one: move the old one aside.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return plan
