"""Build synthetic releases directly in a store (no compiling), for pull and store tests."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from pipeline.contracts.store_layout import channel_key, release_key
from pipeline.store.base import Store
from pipeline.store.blobs import put_blob
from pipeline.store.manifest import MANIFEST_SCHEMA, BucketEntry, Manifest
from pipeline.store.refs import PART_SIZE, FileRef


def make_release(
    store: Store,
    workdir: Path,
    model: str = "m",
    version: str = "v1",
    buckets: dict[str, dict[str, bytes]] | None = None,
    extra_files: dict[str, bytes] | None = None,
    part_size: int | None = PART_SIZE,
    schema: int = MANIFEST_SCHEMA,
) -> Manifest:
    """Upload every file as a blob and write the manifest; returns it. ``part_size=None``
    and ``schema=1``: a release as schema 1 wrote it (no part digests); ``schema=2``: with
    sha256 part digests only (no BLAKE3 ones)."""
    buckets = buckets or {
        "b1_s32": {"prefill.pt2": os.urandom(3000), "decode.pt2": os.urandom(2000)},
        "b2_s64": {"prefill.pt2": os.urandom(5000), "decode.pt2": b""},
    }
    entries = {}
    for name, files in buckets.items():
        refs = []
        for rel, data in files.items():
            local = workdir / f"{model}-{version}-{name}-{rel}"
            local.write_bytes(data)
            refs.append(_as_schema(put_blob(store, local, rel, part_size)[0], schema))
        b, s = name.split("_")
        entries[name] = BucketEntry(
            batch=int(b[1:]), seq=int(s[1:]), cache_key="0" * 64, files=refs
        )
    top = []
    for rel, data in (extra_files or {"config.json": b'{"model_type": "llama"}'}).items():
        local = workdir / f"{model}-{version}-top-{rel.replace('/', '_')}"
        local.write_bytes(data)
        top.append(_as_schema(put_blob(store, local, rel, part_size)[0], schema))
    manifest = Manifest(
        schema_version=schema,
        model=model,
        version=version,
        created=datetime.now(timezone.utc).isoformat(),
        weights_digest="1" * 64,
        backend="cpu",
        target={"instance_type": "inf2.xlarge", "tp_degree": 1, "gqa_strategy": "auto"},
        dtype="float32",
        grid={"batch_sizes": [1, 2], "sequence_lengths": [32, 64]},
        gqa={},
        versions={"torch": "2.13.0"},
        flags=[],
        auto_cast_type="fp32",
        config={},
        files=top,
        buckets=entries,
    )
    store.put_bytes(
        release_key(model, version), manifest.model_dump_json(indent=2).encode(), if_absent=True
    )
    return manifest


def _as_schema(ref: FileRef, schema: int) -> FileRef:
    return ref if schema >= 3 else ref.model_copy(update={"parts_blake3": None})


def point_channel(store: Store, model: str, channel: str, version: str) -> None:
    store.put_bytes(channel_key(model, channel), f'{{"version": "{version}"}}'.encode())
