"""Compile cache keys: sha256 over everything that changes what compile writes.

Two keys (docs/finetune.md): a *graph key* per bucket over everything that reaches the
compiled graphs, and a *weights key* per release over the weights and how they are prepared.
A new checkpoint of the same architecture changes only the weights key: no bucket compiles.

Importable without torch: ``publish`` calls ``bucket_cache_key`` to assemble a release from
cache entries, and a no-op recompile must stay fast. The weights digest is the only slow
part, so it is computed once per process per checkpoint, and remembered across runs in an
optional stat cache (path, size, mtime: the same shortcut ``git status`` takes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.contracts.bucket import Bucket, prefill_lengths
from pipeline.contracts.digests import (
    digest,
    model_config_digest,
    read_model_config,
    weights_digest,
)
from pipeline.plan.config import Release
from pipeline.plan.report import release_gqa_plan

# Bump when what a backend writes for the same inputs changes (graph ABI, file layout).
# 3: graphs and prepared weights cached apart; 4: graph ABI 3; 5: graph ABI 4 (slots);
# 6: graph ABI 5 (mixed graphs); 7: graph ABI 6 (a mixed graph's prompts packed)
FORMAT_VERSION = 7
# config.json fields that never reach the compiled graphs (a deny-list, on purpose: a field
# we do not know is treated as one the graphs bake in, so an unknown field costs at worst a
# needless recompile, never a graph paired with an architecture it was not built for).
#   _name_or_path, _commit_hash: where the checkpoint came from; our decoder reads the first
#       only to name the file in an error message.
#   architectures: the HF class name; the decoder dispatches on model_type, which stays in.
#   transformers_version: the writer's version (the version that runs is in "versions").
#   torch_dtype, dtype: the dtype the checkpoint was saved in; the graphs are built in the
#       release config's model.dtype, which is in the key.
#   bos/eos/pad_token_id: read by generation and the tokenizer, outside the graphs (they
#       return logits and their argmax over the whole vocabulary). The release carries the
#       checkpoint's own config.json beside the graphs, so loaders still see the new ids.
NON_GRAPH_FIELDS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    }
)


def architecture(checkpoint: Path) -> dict[str, Any]:
    """config.json without the fields that never reach the graphs (``NON_GRAPH_FIELDS``)."""
    return {k: v for k, v in read_model_config(checkpoint).items() if k not in NON_GRAPH_FIELDS}


def architecture_digest(checkpoint: Path) -> str:
    return digest(architecture(checkpoint))


def key_material(
    release: Release,
    bucket: Bucket,
    backend: str,
    *,
    weights: str | None = None,
    versions: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Everything that goes into a bucket's *graph* key, as plain data (kept in the entry).

    Not the weights: cpu/cuda graphs are exported on uninitialised tensors and bind their
    weights at load time. A backend whose outputs do embed the weights or the whole
    config.json (``graphs_depend_on_weights``: neuron) gets both in its graph key."""
    from pipeline.compile.backends import get_backend  # registry imports stay lazy

    if backend == "auto":
        raise ValueError("resolve the backend before computing cache keys")
    cfg = release.config
    be = get_backend(backend)
    material: dict[str, Any] = {
        "kind": "graphs",
        "format": FORMAT_VERSION,
        "architecture": architecture_digest(release.checkpoint),
        "bucket": {"batch": bucket.batch, "seq": bucket.seq},
        "tp": cfg.target.tp_degree,
        "gqa": release_gqa_plan(release).to_dict(),
        "dtype": cfg.model.dtype,
        "backend": backend,
        "versions": versions if versions is not None else be.versions(),
        "flags": list(cfg.compiler.flags),
        "auto_cast_type": cfg.compiler.auto_cast_type,
        "options": be.key_options(cfg.compiler.flags, cfg.target.instance_type),
    }
    if be.prefill_per_length:
        prefill = prefill_lengths(bucket, release.grid.prefill_lengths)
        material["prefill_lengths"] = list(prefill)
        mixed = be.mixed_lengths(bucket, release.grid.mixed_lengths)
        if mixed:  # in the key only where there are any
            material["mixed_lengths"] = list(mixed)
    if be.graphs_depend_on_weights:
        material["weights"] = weights or weights_digest(release.checkpoint)
        material["model_config"] = model_config_digest(release.checkpoint)
    return material


def bucket_cache_key(
    release: Release,
    bucket: Bucket,
    backend: str,
    *,
    weights: str | None = None,
    versions: dict[str, str] | None = None,
) -> str:
    """The graph key of one bucket: sha256 of ``key_material`` as canonical JSON."""
    return digest(key_material(release, bucket, backend, weights=weights, versions=versions))


graph_key = bucket_cache_key


def weights_key_material(
    release: Release,
    backend: str,
    *,
    weights: str | None = None,
    versions: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Everything the prepared weights (one set per release, shared by every bucket) depend
    on: the checkpoint's weights, and what preparing them does to them. The architecture is
    in because preparation reads it (fused q/k/v and gate/up split points, tied embeddings,
    the rope frequencies written beside the weights), so prepared weights can only ever be
    found for the architecture they were prepared for."""
    from pipeline.compile.backends import get_backend

    if backend == "auto":
        raise ValueError("resolve the backend before computing cache keys")
    cfg = release.config
    return {
        "kind": "weights",
        "format": FORMAT_VERSION,  # the prepared layout (fusion, names, file format)
        "weights": weights or weights_digest(release.checkpoint),
        "architecture": architecture_digest(release.checkpoint),
        "tp": cfg.target.tp_degree,
        "gqa": release_gqa_plan(release).to_dict(),  # head padding
        "dtype": cfg.model.dtype,
        "backend": backend,
        # transformers computes the rope frequencies; torch writes the file
        "versions": versions if versions is not None else get_backend(backend).versions(),
    }


def weights_key(
    release: Release,
    backend: str,
    *,
    weights: str | None = None,
    versions: dict[str, str] | None = None,
) -> str:
    """The key of a release's prepared weights: sha256 of ``weights_key_material``."""
    return digest(weights_key_material(release, backend, weights=weights, versions=versions))
