"""Assembling a release: a config, its buckets' graph entries and its prepared-weights entry
→ a manifest.

Finds each bucket's graph entry and the release's weights entry by recomputing their keys
(``pipeline.compile.keys``), so it runs where compile ran (same image, same checkpoint),
then hands the manifest and its blob sources to the store's publish protocol
(``pipeline.store.publish``). Each bucket of the manifest names its graphs' files and the
weights' files, and records both keys (docs/finetune.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.contracts.backend_table import AUTO_ORDER
from pipeline.contracts.store_layout import check_version
from pipeline.errors import InputError, MissingBucketsError, PipelineError
from pipeline.plan.config import Release
from pipeline.store import open_store
from pipeline.store._redact import scrub
from pipeline.store.base import Store
from pipeline.store.cache import CacheEntry, read_cache_entry
from pipeline.store.manifest import BucketEntry, Manifest
from pipeline.store.publish import (
    DEFAULT_JOBS,
    BlobSource,
    ProgressFn,
    PublishResult,
    publish,
)
from pipeline.store.refs import FileRef, file_ref
from pipeline.store.signing import Signer

# (release, bucket, backend) -> graph key; the compile stage owns the real one.
KeyFn = Callable[..., str]
# (release, backend) -> weights key, or None where the backend's graphs hold the weights.
WeightsKeyFn = Callable[..., str | None]
# Checkpoint files a loader may want beside the compiled graphs (never the weights).
RELEASE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # transformers ≥ 4.50 saves the chat template here, not in the config
    "special_tokens_map.json",
    "tokenizer.model",
)


def default_key_fn() -> KeyFn:
    try:
        from pipeline.compile.keys import bucket_cache_key
    except ImportError:
        raise InputError(
            "publish", "the compile stage is not installed", "install inf2-pipeline[torch]"
        ) from None

    def key(release: Release, bucket: Any, backend: str) -> str:
        try:
            return bucket_cache_key(release, bucket, backend)
        except InputError:
            raise
        except PipelineError:
            # A key names the toolchain's versions (neuronx-cc --version): where the toolchain
            # is missing, say so as compile does (exit 2, how to install it), not as a failed
            # subprocess. Checked only on failure: cuda keys need no GPU, so a CPU machine
            # may publish what a GPU machine compiled.
            from pipeline.compile.backends import resolve_backend

            resolve_backend(backend)
            raise

    return key


def default_weights_key_fn() -> WeightsKeyFn:
    from pipeline.compile.backends import get_backend
    from pipeline.compile.keys import weights_key

    def key(release: Release, backend: str) -> str | None:
        if get_backend(backend).graphs_depend_on_weights:
            return None
        return weights_key(release, backend)

    return key


def no_weights_entry(release: Release, backend: str) -> None:
    """For key functions whose graph entries hold the weights too."""
    return None


def find_entries(
    release: Release,
    cache: Store,
    key_fn: KeyFn,
    backend: str | None = None,
    shard_count: int | None = None,
    weights_key_fn: WeightsKeyFn = no_weights_entry,
) -> tuple[str, dict[str, CacheEntry], CacheEntry | None]:
    """(backend, bucket name -> graph entry, the weights entry or None) for every bucket of
    the release (None: that backend's graph entries hold the weights).

    ``backend`` None means the config's; for "auto", the first of neuron, cuda, cpu that has
    an entry for every bucket (publishing may run on another machine than compiling).
    ``shard_count``: how many shards compiled it, so a missing bucket names its shard.
    """
    backend = backend or release.config.target.backend
    candidates = AUTO_ORDER if backend == "auto" else (backend,)
    best: tuple[str, dict[str, CacheEntry], list[str], bool] | None = None
    for name in candidates:
        try:
            found, missing = _entries_for(release, cache, key_fn, name)
            wkey = weights_key_fn(release, name)
            weights = read_cache_entry(cache, wkey) if wkey else None
        except PipelineError:
            if backend != "auto":
                raise
            continue  # e.g. no neuronx-cc here to name the key: that backend cannot match
        no_weights = bool(wkey) and weights is None
        if not missing and not no_weights:
            return name, found, weights
        if best is None or len(found) > len(best[1]):
            best = (name, found, missing, no_weights)
    if best is None:
        raise MissingBucketsError(
            f"release {release.name}",
            "no backend's cache keys can be computed on this machine",
            "publish with --backend NAME where that backend's toolchain is installed",
        )
    name, _, missing, no_weights = best
    if not missing:  # every shard prepares (or finds) the weights: any re-run makes them
        raise MissingBucketsError(
            f"release {release.name} ({name})",
            "every bucket's graphs are compiled, but the prepared weights of this checkpoint "
            "are not in the cache",
            f"run 'inf2-pipeline compile {release.path}' (it prepares them, compiling nothing)",
        )
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
    weights: CacheEntry | None = None,
) -> Manifest:
    """The manifest of a release (version and creation time filled in by ``publish``).
    ``weights``: the prepared-weights entry every bucket binds (None: in the graph entries)."""
    from pipeline.plan.report import release_gqa_plan

    cfg = release.config
    gqa = release_gqa_plan(release)
    metas = [e.meta for e in entries.values()]
    # With a weights entry, it alone says which weights: the graphs serve any checkpoint.
    said = _agreed([weights.meta] if weights is not None else metas, "weights_digest")
    digest = weights_digest or said or "unknown"
    weight_files = list(weights.files) if weights is not None else []
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
            **(
                {"prefill_lengths": list(release.grid.prefill_lengths)}
                if release.grid.prefill_lengths
                else {}
            ),
        },
        gqa=gqa.to_dict(),
        versions=dict(sorted(versions.items())),
        flags=list(cfg.compiler.flags),
        auto_cast_type=cfg.compiler.auto_cast_type,
        config=source,
        files=release_files,
        buckets={
            name: BucketEntry(
                batch=b.batch,
                seq=b.seq,
                cache_key=entries[name].key,
                weights_key=weights.key if weights is not None else None,
                files=[*entries[name].files, *weight_files],
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
    weights_key_fn: WeightsKeyFn | None = None,
    signer: Signer | None = None,
) -> PublishResult:
    """Publish what compile produced for ``release`` into ``store`` (default: the config's
    store, which is also where the compile cache lives). ``key_fn`` without
    ``weights_key_fn``: its graph entries hold the weights too."""
    if version is not None:  # before reading the cache: a bad name fails at once
        check_version(version)
    cache = open_store(release.store_url)
    dest = store or cache
    if weights_key_fn is None:
        weights_key_fn = default_weights_key_fn() if key_fn is None else no_weights_entry
    backend, entries, weights = find_entries(
        release, cache, key_fn or default_key_fn(), backend, shard_count, weights_key_fn
    )
    sources: dict[str, BlobSource] = {}
    top = []
    for rel, path in checkpoint_files(release.checkpoint).items():
        ref = file_ref(path, rel)
        top.append(ref)
        sources[ref.sha256] = path
    for entry in [*entries.values(), *([weights] if weights else [])]:
        for ref in entry.files:
            sources.setdefault(ref.sha256, cache)
    manifest = build_manifest(release, backend, entries, top, weights=weights)
    return publish(
        dest, manifest, sources, version=version, jobs=jobs, progress=progress, signer=signer
    )
