"""Publish: turn compile cache entries into an immutable release.

Protocol (DESIGN.md "Artifact store"):

1. Assemble the manifest from the config and the cache entries of its buckets (the compile
   stage wrote those, with their blobs, into the config's store).
2. Upload only the blobs the destination lacks, concurrently (the S3 store uses multipart,
   concurrent transfers for large files). Republishing unchanged content uploads nothing.
3. Check once more that every blob the manifest names is there, then write the manifest
   last, with a conditional create (``If-None-Match: *`` in S3, ``link`` locally).

A crash before step 3 leaves only unreferenced blobs (``gc`` collects them); a crash after it
leaves a complete release. An existing version is never overwritten: publishing different
content under it fails; publishing the same content again is a no-op (a re-run after a
crash succeeds).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline._files import sha256_file
from pipeline.config import Release
from pipeline.errors import (
    AlreadyExistsError,
    InputError,
    IntegrityError,
    MissingBucketsError,
    NotFoundError,
    PipelineError,
)
from pipeline.store import open_store
from pipeline.store._redact import scrub
from pipeline.store.base import Store
from pipeline.store.blobs import FileRef
from pipeline.store.cache import CacheEntry, read_cache_entry
from pipeline.store.layout import blob_key, release_key
from pipeline.store.manifest import BucketEntry, Manifest, parse_manifest

# (release, bucket, backend) -> cache key; the compile stage owns the real one.
KeyFn = Callable[..., str]
# Where a blob's bytes come from: a local file, or a store that holds blobs/sha256/<hex>.
BlobSource = Path | Store
ProgressFn = Callable[[int], None]

BACKEND_PREFERENCE = ("neuron", "cuda", "cpu")  # for target.backend "auto"
# Checkpoint files a loader may want beside the compiled graphs (never the weights).
RELEASE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
DEFAULT_JOBS = 8


@dataclass(frozen=True)
class PublishResult:
    model: str
    version: str
    store: str
    manifest: str  # its key in the store
    created: bool  # False: this exact content was already published under this version
    files: int
    total_bytes: int
    uploaded_files: int
    uploaded_bytes: int
    seconds: float
    content_digest: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_key_fn() -> KeyFn:
    try:
        from pipeline.compile.keys import bucket_cache_key
    except ImportError:
        raise InputError(
            "publish", "the compile stage is not installed", "install inf2-pipeline[torch]"
        ) from None
    return bucket_cache_key


def default_version(manifest: Manifest, now: datetime | None = None) -> str:
    """UTC date plus a short digest of the content: ``20250101-1a2b3c4d``."""
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%d}-{manifest.content_digest()[:8]}"


# --- assembling -------------------------------------------------------------------------


def find_entries(
    release: Release,
    cache: Store,
    key_fn: KeyFn,
    backend: str | None = None,
    shard_count: int | None = None,
) -> tuple[str, dict[str, CacheEntry]]:
    """(backend, bucket name -> cache entry) for every bucket of the release.

    ``backend`` None means the config's; for "auto", the first of neuron, cuda, cpu that has
    an entry for every bucket (publishing may run on another machine than compiling).
    ``shard_count``: how many shards compiled it, so a missing bucket names its shard.
    """
    backend = backend or release.config.target.backend
    candidates = BACKEND_PREFERENCE if backend == "auto" else (backend,)
    best: tuple[str, dict[str, CacheEntry], list[str]] | None = None
    for name in candidates:
        try:
            found, missing = _entries_for(release, cache, key_fn, name)
        except PipelineError:
            if backend != "auto":
                raise
            continue  # e.g. no neuronx-cc here to name the key: that backend cannot match
        if not missing:
            return name, found
        if best is None or len(found) > len(best[1]):
            best = (name, found, missing)
    if best is None:
        raise MissingBucketsError(
            f"release {release.name}",
            "no backend's cache keys can be computed on this machine",
            "publish with --backend NAME where that backend's toolchain is installed",
        )
    name, _, missing = best
    owners = _shard_owners(release, shard_count)
    named = [f"{m} (shard {owners[m]}/{shard_count})" if owners else m for m in missing]
    shards = sorted({owners[m] for m in missing}) if owners else []
    rerun = (
        f"re-run 'inf2-pipeline compile {release.path} --shard I/{shard_count}' for I in "
        f"{', '.join(map(str, shards))}"
        if owners
        else f"run 'inf2-pipeline compile {release.path}' first (or pass --shard-count N to "
        "name the shards that should have produced them)"
    )
    raise MissingBucketsError(
        f"release {release.name} ({name})",
        f"no compiled artifacts for {len(missing)} of {len(release.buckets)} buckets: "
        f"{', '.join(named[:8])}{' …' if len(named) > 8 else ''}",
        rerun,
    )


def _shard_owners(release: Release, shard_count: int | None) -> dict[str, int]:
    """Bucket name -> the shard index that compiles it (the split is deterministic)."""
    if not shard_count:
        return {}
    from pipeline.compile.shards import split

    return {b.name: i for i, part in enumerate(split(release.buckets, shard_count)) for b in part}


def _entries_for(
    release: Release, cache: Store, key_fn: KeyFn, backend: str
) -> tuple[dict[str, CacheEntry], list[str]]:
    buckets = release.buckets
    keys = [key_fn(release, b, backend) for b in buckets]
    with ThreadPoolExecutor(DEFAULT_JOBS) as pool:
        entries = list(pool.map(lambda k: read_cache_entry(cache, k), keys))
    found = {b.name: e for b, e in zip(buckets, entries, strict=True) if e is not None}
    return found, [b.name for b, e in zip(buckets, entries, strict=True) if e is None]


def build_manifest(
    release: Release,
    backend: str,
    entries: Mapping[str, CacheEntry],
    release_files: list[FileRef],
    *,
    weights_digest: str | None = None,
) -> Manifest:
    """The manifest of a release (version and creation time filled in by ``publish``)."""
    from pipeline.plan import release_gqa_plan

    cfg = release.config
    gqa = release_gqa_plan(release)
    metas = [e.meta for e in entries.values()]
    digest = weights_digest or _agreed(metas, "weights_digest") or "unknown"
    versions: dict[str, str] = {}
    for meta in metas:
        for k, v in (meta.get("versions") or {}).items():
            seen = versions.setdefault(k, str(v))
            if seen != str(v):
                versions[k] = ", ".join(sorted({*seen.split(", "), str(v)}))
    versions["inf2-pipeline"] = __version__
    source = dict(release.source)
    if isinstance(source.get("store"), str):
        source["store"] = scrub(source["store"])
    return Manifest(
        model=release.name,
        version="unversioned",
        created="",
        weights_digest=digest,
        backend=backend,
        target={
            "instance_type": cfg.target.instance_type,
            "tp_degree": cfg.target.tp_degree,
            "gqa_strategy": cfg.target.gqa_strategy,
        },
        dtype=cfg.model.dtype,
        grid={
            "batch_sizes": list(release.grid.batch_sizes),
            "sequence_lengths": list(release.grid.sequence_lengths),
        },
        gqa=gqa.to_dict(),
        versions=dict(sorted(versions.items())),
        flags=list(cfg.compiler.flags),
        auto_cast_type=cfg.compiler.auto_cast_type,
        config=source,
        files=release_files,
        buckets={
            name: BucketEntry(
                batch=b.batch, seq=b.seq, cache_key=entries[name].key, files=entries[name].files
            )
            for b in release.buckets
            if (name := b.name) in entries
        },
    )


def _agreed(metas: list[dict[str, Any]], key: str) -> str | None:
    values = {str(m[key]) for m in metas if m.get(key)}
    if len(values) > 1:
        raise InputError(
            f"cache entries' {key}",
            f"buckets were compiled from different inputs ({len(values)} values)",
            "recompile the release",
        )
    return values.pop() if values else None


def checkpoint_files(checkpoint: Path) -> dict[str, Path]:
    """Small release-wide files of the checkpoint (config, tokenizer), by relative path."""
    return {name: checkpoint / name for name in RELEASE_FILES if (checkpoint / name).is_file()}


def publish_release(
    release: Release,
    *,
    store: Store | None = None,
    version: str | None = None,
    backend: str | None = None,
    key_fn: KeyFn | None = None,
    jobs: int = DEFAULT_JOBS,
    progress: ProgressFn | None = None,
    shard_count: int | None = None,
) -> PublishResult:
    """Publish what compile produced for ``release`` into ``store`` (default: the config's
    store, which is also where the compile cache lives)."""
    cache = open_store(release.store_url)
    dest = store or cache
    backend, entries = find_entries(
        release, cache, key_fn or default_key_fn(), backend, shard_count
    )
    sources: dict[str, BlobSource] = {}
    top = []
    for rel, path in checkpoint_files(release.checkpoint).items():
        ref = _local_ref(path, rel)
        top.append(ref)
        sources[ref.sha256] = path
    for entry in entries.values():
        for ref in entry.files:
            sources.setdefault(ref.sha256, cache)
    manifest = build_manifest(release, backend, entries, top)
    return publish(dest, manifest, sources, version=version, jobs=jobs, progress=progress)


def _local_ref(path: Path, rel: str) -> FileRef:
    return FileRef(path=rel, sha256=sha256_file(path), size=path.stat().st_size)


# --- the protocol -------------------------------------------------------------------------


def publish(
    dest: Store,
    manifest: Manifest,
    sources: Mapping[str, BlobSource],
    *,
    version: str | None = None,
    jobs: int = DEFAULT_JOBS,
    progress: ProgressFn | None = None,
) -> PublishResult:
    """Upload the blobs ``dest`` lacks, then create the manifest if absent."""
    t0 = time.monotonic()
    now = datetime.now(timezone.utc)
    version = version or default_version(manifest, now)
    manifest = manifest.model_copy(
        update={"version": version, "created": now.isoformat(timespec="seconds")}
    )
    key = release_key(manifest.model, version)
    refs = {ref.sha256: ref for _, ref in manifest.iter_files()}
    missing = sorted(set(refs) - set(sources))
    if missing:
        raise InputError(f"release {manifest.model} {version}", f"no source for blob {missing[0]}")

    def result(created: bool, uploaded: tuple[int, int] = (0, 0)) -> PublishResult:
        return PublishResult(
            model=manifest.model,
            version=version,
            store=dest.url,
            manifest=key,
            created=created,
            files=sum(1 for _ in manifest.iter_files()),
            total_bytes=manifest.total_size,
            uploaded_files=uploaded[0],
            uploaded_bytes=uploaded[1],
            seconds=round(time.monotonic() - t0, 3),
            content_digest=manifest.content_digest(),
        )

    # Fail before uploading gigabytes when the version is taken by other content.
    if _same_release_exists(dest, manifest, key):
        return result(created=False)
    uploader = _Uploader(dest, sources, progress)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        present = list(pool.map(uploader.ensure, refs.values()))
        # gc never deletes blobs younger than its grace period, and it reads references only
        # from manifests: re-check the blobs we did not upload just before the manifest.
        skipped = [ref for ref, was_there in zip(refs.values(), present, strict=True) if was_there]
        for ref, size in zip(
            skipped, pool.map(lambda r: dest.size(blob_key(r.sha256)), skipped), strict=True
        ):
            if size != ref.size:
                uploader.upload(ref)
    try:
        dest.put_bytes(key, manifest.to_bytes(), if_absent=True)
    except AlreadyExistsError:
        if _same_release_exists(dest, manifest, key):
            return result(created=False, uploaded=uploader.counts())
        raise
    return result(created=True, uploaded=uploader.counts())


def _same_release_exists(dest: Store, manifest: Manifest, key: str) -> bool:
    """True if ``key`` holds this content; AlreadyExistsError if it holds other content."""
    got = dest.get_versioned(key)
    if got is None:
        return False
    existing = parse_manifest(got[0], f"{dest.url}/{key}")
    if existing.content_digest() == manifest.content_digest():
        return True
    raise AlreadyExistsError(
        f"release {manifest.model} {manifest.version}",
        f"already exists in {dest.url} with different content (published {existing.created})",
        "releases are immutable: publish under another --version",
    )


class _Uploader:
    """Uploads missing blobs from their sources, verifying bytes read from another store."""

    def __init__(
        self, dest: Store, sources: Mapping[str, BlobSource], progress: ProgressFn | None
    ) -> None:
        self.dest, self.sources, self.progress = dest, sources, progress
        self._lock = threading.Lock()
        self._files = self._bytes = 0

    def counts(self) -> tuple[int, int]:
        return self._files, self._bytes

    def ensure(self, ref: FileRef) -> bool:
        """Upload ``ref`` unless the destination has it; True if it was already there."""
        if self.dest.size(blob_key(ref.sha256)) == ref.size:
            if self.progress:
                self.progress(ref.size)
            return True
        self.upload(ref)
        return False

    def upload(self, ref: FileRef) -> None:
        key = blob_key(ref.sha256)
        source = self.sources[ref.sha256]
        if isinstance(source, Path):
            self.dest.put_file(key, source)
        elif (local := source.local_path(key)) is not None:
            _verify(local, ref, source.url)
            self.dest.put_file(key, local)
        else:
            with tempfile.TemporaryDirectory(prefix="inf2-publish-") as tmp:
                path = Path(tmp) / ref.sha256
                try:
                    source.get_file(key, path)
                except NotFoundError:
                    raise NotFoundError(
                        f"blob {ref.sha256[:12]} ({ref.path})",
                        f"missing from the compile cache in {source.url}",
                        "recompile the release (gc may have collected it)",
                    ) from None
                _verify(path, ref, source.url)
                self.dest.put_file(key, path)
        with self._lock:
            self._files += 1
            self._bytes += ref.size
        if self.progress:
            self.progress(ref.size)


def _verify(path: Path, ref: FileRef, where: str) -> None:
    """Never republish corrupted bytes: the digest is the blob's name."""
    got = _local_ref(path, ref.path)
    if (got.sha256, got.size) != (ref.sha256, ref.size):
        raise IntegrityError(
            f"blob {ref.sha256[:12]} ({ref.path}) in {where}",
            f"content does not match its digest (got {got.sha256[:12]}, {got.size} bytes)",
            "delete the blob and recompile",
        )
