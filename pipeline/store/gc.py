"""``gc``: delete old releases of a model, then what nothing references any more.

1. Releases of MODEL beyond the newest ``keep`` that no channel points at.
2. Cache entries of MODEL (named by one of its releases, or compiled for it) that no
   remaining release of any model references.
3. Blobs that no remaining release (of any model) and no remaining cache entry names.

Deletions go in that order, so a crash mid-gc never leaves a manifest naming a deleted blob.

Publishing writes blobs (and compile writes cache entries) before the manifest that
references them, so an unreferenced object may belong to a publish in flight. Orphan blobs
and unreferenced cache entries are therefore deleted only when older than a grace period
(default 24 h, longer than any publish or compile-then-publish should take), and a publish
re-checks, just before writing its manifest, that the blobs it skipped are still there. The
remaining window — gc deleting a blob orphaned for longer than the grace period in the
milliseconds between that check and the manifest write of a publish that reuses it — is
documented rather than locked: run gc when no publish of the same store is running, or
keep the grace period long.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.contracts.store_layout import (
    BLOBS_PREFIX,
    CACHE_PREFIX,
    release_key,
    signatures_prefix,
)
from pipeline.errors import AlreadyExistsError, InputError, NotFoundError
from pipeline.store.base import ObjectInfo, Store
from pipeline.store.cache import CacheEntry, read_cache_entry
from pipeline.store.channels import list_channels
from pipeline.store.manifest import BucketEntry, Manifest
from pipeline.store.releases import READ_CONCURRENCY, list_models, list_releases

DEFAULT_GRACE_S = 24 * 3600


@dataclass
class GcResult:
    model: str
    dry_run: bool
    kept: list[str]  # versions, newest first
    deleted_releases: list[str]
    deleted_cache_entries: list[str]
    deleted_blobs: list[str]
    freed_bytes: int
    young_orphans: int  # unreferenced blobs spared by the grace period
    incomplete_uploads: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gc(
    store: Store,
    model: str,
    keep: int,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
) -> GcResult:
    if keep < 0:
        raise InputError("--keep", f"{keep} is negative", "keep 0 or more releases")
    now = time.time()
    releases = list_releases(store, model)  # newest first
    pointed = {ch.version for ch in list_channels(store, model).values()}
    kept = [m for i, m in enumerate(releases) if i < keep or m.version in pointed]
    doomed = [m for m in releases if m not in kept]

    if not dry_run:
        store.delete_many(release_key(model, m.version) for m in doomed)
        # A promote may have pointed a channel at a doomed release while we deleted it:
        # put those manifests back (their blobs are still there: blobs go last).
        now_pointed = {ch.version for ch in list_channels(store, model).values()}
        for m in doomed:
            if m.version in now_pointed:
                _restore(store, m)
                kept.append(m)
        doomed = [m for m in doomed if m not in kept]
        # their signatures go with them (after the restore: a restored release keeps its own)
        store.delete_many(
            k for m in doomed for k in list(store.list(signatures_prefix(model, m.version)))
        )

    remaining = _remaining_releases(store, model, kept, doomed, dry_run)
    used_keys = {k for m in remaining for b in m.buckets.values() for k in _keys(b)}
    used_blobs = {ref.sha256 for m in remaining for _, ref in m.iter_files()}
    ours = {k for m in releases for b in m.buckets.values() for k in _keys(b)}
    cutoff = now - grace_s

    entries = _cache_entries(store)
    if not releases and not pointed and not any(_names(e, model) for _, e in entries):
        # A mistyped name must not go on to sweep the store's orphan blobs.
        raise NotFoundError(
            f"model '{model}'",
            f"has no releases, channels or cache entries in {store.url}",
            f"check the name: 'inf2-pipeline list --store {store.url}' shows the models",
        )
    dead_entries = []
    for info, entry in entries:
        mine = entry is not None and (entry.key in ours or _names(entry, model))
        if mine and entry.key not in used_keys and info.mtime < cutoff:
            dead_entries.append(info.key)
        elif entry is not None:
            used_blobs.update(ref.sha256 for ref in entry.files)

    dead_blobs, freed, young = [], 0, 0
    for info in store.list_info(BLOBS_PREFIX):
        digest = info.key[len(BLOBS_PREFIX) :]
        if digest in used_blobs:
            continue
        if info.mtime < cutoff:
            dead_blobs.append(info.key)
            freed += info.size
        else:
            young += 1

    incomplete = 0
    if not dry_run:
        store.delete_many(dead_entries)
        store.delete_many(dead_blobs)
        incomplete = store.cleanup_incomplete(grace_s)
    return GcResult(
        model=model,
        dry_run=dry_run,
        kept=[m.version for m in sorted(kept, key=lambda m: (m.created, m.version), reverse=True)],
        deleted_releases=[m.version for m in doomed],
        deleted_cache_entries=[k[len(CACHE_PREFIX) : -len(".json")] for k in dead_entries],
        deleted_blobs=[k[len(BLOBS_PREFIX) :] for k in dead_blobs],
        freed_bytes=freed,
        young_orphans=young,
        incomplete_uploads=incomplete,
    )


def _names(entry: CacheEntry | None, model: str) -> bool:
    return entry is not None and entry.meta.get("model") == model


def _keys(bucket: BucketEntry) -> list[str]:
    """The cache entries a release's bucket came from: its graphs and its weights."""
    return [bucket.cache_key, *([bucket.weights_key] if bucket.weights_key else [])]


def _restore(store: Store, manifest: Manifest) -> None:
    with contextlib.suppress(AlreadyExistsError):
        store.put_bytes(
            release_key(manifest.model, manifest.version), manifest.to_bytes(), if_absent=True
        )


def _remaining_releases(
    store: Store, model: str, kept: list[Manifest], doomed: list[Manifest], dry_run: bool
) -> list[Manifest]:
    """Every release that will still exist: ours kept, plus every other model's (read after
    our deletions, so a release published meanwhile is seen)."""
    others = [m for name in list_models(store) if name != model for m in list_releases(store, name)]
    if dry_run:
        return kept + others
    # Re-list our own model too: a release published while we worked must keep its blobs.
    gone = {m.version for m in doomed}
    return [m for m in list_releases(store, model) if m.version not in gone] + others


def _cache_entries(store: Store) -> list[tuple[ObjectInfo, CacheEntry | None]]:
    infos = [i for i in store.list_info(CACHE_PREFIX) if i.key.endswith(".json")]

    # An entry we cannot read fails gc (its read error says what to do): we must not
    # delete blobs it may name.
    def read(info: ObjectInfo) -> CacheEntry | None:
        return read_cache_entry(store, info.key[len(CACHE_PREFIX) : -len(".json")])

    with ThreadPoolExecutor(READ_CONCURRENCY) as pool:
        return list(zip(infos, pool.map(read, infos), strict=True))
