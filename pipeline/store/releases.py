"""Reading releases: list models and releases, read a manifest, resolve a channel.

A release exists exactly when its manifest exists (it is written last), so listing
manifests lists complete releases and nothing else.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pipeline.contracts.store_layout import MODELS_PREFIX, releases_prefix
from pipeline.errors import InputError, NotFoundError
from pipeline.store.base import Store
from pipeline.store.channels import Channel, list_channels, read_channel
from pipeline.store.manifest import Manifest, read_release_bytes

READ_CONCURRENCY = 16


def read_release(store: Store, model: str, version: str) -> Manifest:
    return read_release_bytes(store, model, version)[0]


def resolve_version(
    store: Store, model: str, version: str | None = None, channel: str | None = None
) -> str:
    """The version named, or the one ``channel`` points at (exactly one of the two)."""
    return resolve_pointer(store, model, version, channel)[0]


def resolve_pointer(
    store: Store, model: str, version: str | None = None, channel: str | None = None
) -> tuple[str, Channel | None]:
    """``resolve_version``, with the channel's pointer (None when a version was named)."""
    if (version is None) == (channel is None):
        raise InputError(model, "give exactly one of --version or --channel", None)
    if channel is None:
        return version, None
    pointer = read_channel(store, model, channel)
    if pointer is None:
        raise NotFoundError(
            f"channel '{channel}' of model '{model}'",
            f"not found in {store.url}",
            f"promote a release first: 'inf2-pipeline promote {model} VERSION --channel {channel}'",
        )
    return pointer.version, pointer


def resolve_release(
    store: Store, model: str, version: str | None = None, channel: str | None = None
) -> Manifest:
    """The release named by ``version`` or pointed at by ``channel`` (exactly one)."""
    return read_release(store, model, resolve_version(store, model, version, channel))


def list_models(store: Store) -> list[str]:
    models = set()
    for key in store.list(MODELS_PREFIX):
        parts = key.split("/")  # models/<m>/releases/<v>.json
        if len(parts) == 4 and parts[2] == "releases" and parts[3].endswith(".json"):
            models.add(parts[1])
    return sorted(models)


def list_versions(store: Store, model: str) -> list[str]:
    prefix = releases_prefix(model)
    return sorted(
        k[len(prefix) : -len(".json")]
        for k in store.list(prefix)
        if k.endswith(".json") and "/" not in k[len(prefix) :]
    )


def list_releases(store: Store, model: str) -> list[Manifest]:
    """Every release of ``model``, newest first (by creation time, then version)."""
    versions = list_versions(store, model)
    with ThreadPoolExecutor(READ_CONCURRENCY) as pool:
        manifests = [
            m
            for m in pool.map(lambda v: _read_if_present(store, model, v), versions)
            if m is not None
        ]
    return sorted(manifests, key=lambda m: (m.created, m.version), reverse=True)


def _read_if_present(store: Store, model: str, version: str) -> Manifest | None:
    try:
        return read_release(store, model, version)
    except NotFoundError:  # deleted (gc) between listing and reading
        return None


def channels_by_version(store: Store, model: str) -> dict[str, list[str]]:
    """version -> the channels pointing at it."""
    out: dict[str, list[str]] = {}
    for name, ch in sorted(list_channels(store, model).items()):
        out.setdefault(ch.version, []).append(name)
    return out


__all__ = [
    "channels_by_version",
    "list_models",
    "list_releases",
    "list_versions",
    "read_release",
    "resolve_pointer",
    "resolve_release",
    "resolve_version",
]
