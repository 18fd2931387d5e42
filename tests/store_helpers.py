"""Synthetic compile output for store tests: blobs + cache entries, no compiler involved."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from pipeline.contracts.bucket import Bucket
from pipeline.plan.config import Release
from pipeline.store.base import Store
from pipeline.store.blobs import put_blob
from pipeline.store.cache import CacheEntry, write_cache_entry
from tests.config_factory import release_yaml

TINY_CONFIG_JSON = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}


def fake_key(release: Release, bucket: Bucket, backend: str) -> str:
    """Stands in for compile's bucket_cache_key: what matters here is one key per input."""
    flags = " ".join(release.config.compiler.flags)
    text = f"{release.name}|{bucket.name}|{backend}|{flags}|{release.config.model.dtype}"
    return hashlib.sha256(text.encode()).hexdigest()


def write_checkpoint(path: Path) -> Path:
    """A checkpoint directory with only config.json: all publish reads from it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG_JSON, indent=2))
    return path


def write_release_config(
    tmp: Path,
    store: str,
    *,
    model: str = "tiny",
    batch_sizes: tuple[int, ...] = (1, 2),
    sequence_lengths: tuple[int, ...] = (32, 64),
    flags: str = "",
    backend: str = "cpu",
    name: str = "release.yaml",
) -> Path:
    ckpt = write_checkpoint(tmp / "ckpt")
    path = tmp / name
    path.write_text(
        release_yaml(
            name=model,
            checkpoint=ckpt,
            backend=backend,
            batch_sizes=batch_sizes,
            sequence_lengths=sequence_lengths,
            flags=flags,
            auto_cast_type="fp32",
            store=store,
        )
    )
    return path


def bucket_files(bucket: Bucket, salt: str = "") -> dict[str, bytes]:
    """Deterministic per-bucket content (a different ``salt`` changes every byte)."""
    seed = hashlib.sha256(f"{bucket.name}{salt}".encode()).digest()
    return {
        "prefill.pt2": seed * (64 * bucket.batch),
        "decode.pt2": seed[::-1] * (32 * bucket.batch),
        "compile.log": f"compiled {bucket.name}{salt}\n".encode(),
    }


def fake_compile(
    release: Release,
    store: Store,
    workdir: Path,
    *,
    backend: str = "cpu",
    files: Callable[[Bucket], dict[str, bytes]] = bucket_files,
    only: set[str] | None = None,
    key_fn: Callable[[Release, Bucket, str], str] = fake_key,
) -> dict[str, CacheEntry]:
    """What the compile stage leaves in the store: each bucket's blobs, then its entry."""
    entries = {}
    for bucket in release.buckets:
        if only is not None and bucket.name not in only:
            continue
        refs = []
        for rel, data in files(bucket).items():
            local = workdir / "compiled" / bucket.name / rel
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
            refs.append(put_blob(store, local, rel)[0])
        entry = CacheEntry(
            key=key_fn(release, bucket, backend),
            bucket=bucket.name,
            backend=backend,
            files=refs,
            meta={
                "model": release.name,
                "weights_digest": "ab" * 32,
                "versions": {"torch": "2.13.0", "transformers": "5.0.0"},
            },
        )
        write_cache_entry(store, entry)
        entries[bucket.name] = entry
    return entries


def fake_prepare(release: Release, store: Store, workdir: Path, backend: str = "cpu") -> CacheEntry:
    """What compile leaves for the release's prepared weights, under compile's weights key."""
    from pipeline.compile.keys import weights_key

    local = workdir / "prepared" / "weights.safetensors"
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(hashlib.sha256(release.name.encode()).digest() * 64)
    entry = CacheEntry(
        key=weights_key(release, backend),
        kind="weights",
        bucket="*",
        backend=backend,
        files=[put_blob(store, local, "weights.safetensors")[0]],
        meta={"model": release.name, "weights_digest": "cd" * 32},
    )
    write_cache_entry(store, entry)
    return entry


def race(n: int, fn: Callable[[int], object]) -> tuple[dict[int, object], dict[int, Exception]]:
    """Run ``fn(0..n-1)`` in n threads released together by a barrier: (results, errors)."""
    import threading

    barrier = threading.Barrier(n)
    results: dict[int, object] = {}
    errors: dict[int, Exception] = {}

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors
