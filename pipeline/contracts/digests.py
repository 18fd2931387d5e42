"""The digests that name what a release was built from: a checkpoint's weight files, its
config.json, and any JSON value (canonical). Compile keys its caches with them
(``pipeline.compile.keys``); parity checks that a release was compiled from the checkpoint it
is given."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline._files import atomic_write_text, sha256_file
from pipeline.errors import CheckpointError

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


def read_model_config(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(str(path), f"unreadable: {e}", None) from None
    if not isinstance(data, dict):
        raise CheckpointError(str(path), "not a JSON object", None)
    return data


def model_config_digest(checkpoint: Path) -> str:
    """sha256 of config.json's content (canonical JSON: whitespace and key order ignored)."""
    return digest(read_model_config(checkpoint))


def digest(data: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
