"""The release manifest, ``models/<model>/releases/<version>.json``.

What is not in the manifest does not exist: it names every file of every bucket with its
sha256 and size, and every fact a loader needs to decide whether it can run the release.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.store.blobs import FileRef

MANIFEST_SCHEMA = 1


class BucketEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: int = Field(gt=0)
    seq: int = Field(gt=0)
    cache_key: str
    files: list[FileRef]


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = MANIFEST_SCHEMA
    model: str
    version: str
    created: str  # ISO 8601, UTC
    weights_digest: str  # sha256 over the checkpoint's weight files (see compile.keys)
    backend: str  # neuron | cuda | cpu
    target: dict[str, Any]  # instance_type, tp_degree, gqa_strategy
    dtype: str
    grid: dict[str, list[int]]  # batch_sizes, sequence_lengths
    gqa: dict[str, Any]  # GqaPlan.to_dict()
    versions: dict[str, str]  # torch, transformers, neuronx-cc, inf2-pipeline ...
    flags: list[str]
    auto_cast_type: str
    config: dict[str, Any]  # the source config as written
    files: list[FileRef] = Field(default_factory=list)  # release-wide files (model config.json)
    buckets: dict[str, BucketEntry]  # keyed by Bucket.name
