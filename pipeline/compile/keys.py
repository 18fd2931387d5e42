"""Compile cache keys: sha256 over everything that changes a bucket's compiled output.

Importable without torch: ``publish`` calls ``bucket_cache_key`` to assemble a release from
cache entries, and a no-op recompile must stay fast. The weights digest is the only slow
part, so it is computed once per process per checkpoint, and remembered across runs in an
optional stat cache (path, size, mtime: the same shortcut ``git status`` takes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline._files import atomic_write_text, sha256_file
from pipeline.errors import CheckpointError
from pipeline.plan.buckets import Bucket
from pipeline.plan.config import Release
from pipeline.plan.report import release_gqa_plan

# Bump when what a backend writes for the same inputs changes (graph ABI, file layout).
FORMAT_VERSION = 2
# Files that hold weights, in every layout transformers writes.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")

_memo: dict[tuple, str] = {}


def weights_digest(checkpoint: Path, *, stat_cache: Path | None = None) -> str:
    """sha256 over the checkpoint's weight files (names and contents), sorted by name."""
    files = _weight_files(Path(checkpoint))
    stats = tuple((f.name, *_stat(f)) for f in files)
    memo_key = (str(Path(checkpoint).resolve()), stats)
    if memo_key in _memo:
        return _memo[memo_key]
    known = _read_stat_cache(stat_cache)
    h = hashlib.sha256()
    fresh = {}
    for f, st in zip(files, stats, strict=True):
        entry_key = f"{f.resolve()}|{st[1]}|{st[2]}|{st[3]}"
        file_digest = known.get(entry_key) or sha256_file(f)
        fresh[entry_key] = file_digest
        h.update(f"{f.name}\0{file_digest}\n".encode())
    if stat_cache is not None and fresh.keys() - known.keys():
        atomic_write_text(stat_cache, json.dumps({**known, **fresh}, indent=1))
    _memo[memo_key] = h.hexdigest()
    return _memo[memo_key]


def _weight_files(checkpoint: Path) -> list[Path]:
    files = sorted({f for p in WEIGHT_PATTERNS for f in checkpoint.glob(p) if f.is_file()})
    if not files:
        raise CheckpointError(
            str(checkpoint),
            "no weight files (*.safetensors, *.bin)",
            "point model.checkpoint at a checkpoint with weights",
        )
    return files


def _stat(f: Path) -> tuple[int, int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _read_stat_cache(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a damaged cache costs one re-hash, never a wrong key


def model_config_digest(checkpoint: Path) -> str:
    """sha256 of config.json's content (canonical JSON: whitespace and key order ignored)."""
    path = Path(checkpoint) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(str(path), f"unreadable: {e}", None) from None
    return digest(data)


def key_material(
    release: Release,
    bucket: Bucket,
    backend: str,
    *,
    weights: str | None = None,
    versions: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Everything that goes into a bucket's key, as plain data (kept in the cache entry)."""
    from pipeline.compile.backends import get_backend  # registry imports stay lazy

    if backend == "auto":
        raise ValueError("resolve the backend before computing cache keys")
    cfg = release.config
    be = get_backend(backend)
    return {
        "format": FORMAT_VERSION,
        "weights": weights or weights_digest(release.checkpoint),
        "model_config": model_config_digest(release.checkpoint),
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


def bucket_cache_key(
    release: Release,
    bucket: Bucket,
    backend: str,
    *,
    weights: str | None = None,
    versions: dict[str, str] | None = None,
) -> str:
    """The cache key of one bucket: sha256 of ``key_material`` as canonical JSON."""
    return digest(key_material(release, bucket, backend, weights=weights, versions=versions))


def digest(data: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
