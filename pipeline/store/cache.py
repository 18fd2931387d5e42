"""Compile cache entries, ``cache/<key>.json``: what one bucket's graphs compiled to
(``kind`` "graphs", under its graph key), or a release's prepared weights (``kind``
"weights", under its weights key; ``bucket`` is "*": every bucket binds them). Both kinds
share one content-addressed key space: the key material names its kind, so keys never meet.

An entry is written only after every blob it names is in the store, so an entry that
exists is always complete (a crash leaves at most unreferenced blobs, collected by gc).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.contracts.store_layout import cache_key
from pipeline.errors import StoreError
from pipeline.store.base import Store
from pipeline.store.blobs import get_blob
from pipeline.store.refs import FileRef

CACHE_SCHEMA = 2  # 2: kind (graphs | weights)


class CacheEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = CACHE_SCHEMA
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    kind: Literal["graphs", "weights"] = "graphs"
    bucket: str  # Bucket.name, e.g. b1_s128; "*" for weights
    backend: str
    files: list[FileRef]
    # What went into the key (for humans and `diff`) plus compile facts: seconds, versions.
    meta: dict[str, Any] = Field(default_factory=dict)
    created: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())


def read_cache_entry(store: Store, key: str) -> CacheEntry | None:
    got = store.get_versioned(cache_key(key))
    if got is None:
        return None
    try:
        return CacheEntry.model_validate(json.loads(got[0]))
    except (ValueError, ValidationError) as e:
        raise StoreError(
            f"{store.url}/{cache_key(key)}",
            f"unreadable cache entry: {e}",
            "delete it; the bucket will be recompiled",
        ) from None


def write_cache_entry(store: Store, entry: CacheEntry) -> None:
    """Write the entry (blobs must already be uploaded). Same key, same content: overwrite ok."""
    store.put_bytes(cache_key(entry.key), entry.model_dump_json(indent=2).encode())


def fetch_cache_entry(store: Store, entry: CacheEntry, dest: Path) -> None:
    """Download every file of an entry into ``dest`` (a cache hit instead of a compile)."""
    for ref in entry.files:
        get_blob(store, ref, dest / ref.path)
