"""Where things live in a store (DESIGN.md "Artifact store"). The only place keys are built."""

from __future__ import annotations

import re

from pipeline.errors import InputError

# Model, version and channel names: safe as one path segment and as one S3 key segment.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NAME = re.compile(NAME_PATTERN)
_HEX = re.compile(r"^[0-9a-f]{64}$")


def _check(kind: str, value: str) -> str:
    if not _NAME.match(value):
        raise InputError(
            f"{kind} '{value}'",
            "not a valid name",
            "use letters, digits, '.', '_' and '-' (up to 128)",
        )
    return value


def check_version(version: str) -> str:
    """``version`` if it is a valid release version (the rule ``release_key`` applies):
    for checking a ``--version`` before compiling or uploading anything."""
    return _check("version", version)


def blob_key(digest: str) -> str:
    if not _HEX.match(digest):
        raise InputError(f"digest '{digest}'", "not a sha256 hex digest", None)
    return f"blobs/sha256/{digest}"


def release_key(model: str, version: str) -> str:
    return f"models/{_check('model', model)}/releases/{_check('version', version)}.json"


def releases_prefix(model: str) -> str:
    return f"models/{_check('model', model)}/releases/"


def signature_key(model: str, version: str, manifest_sha256: str) -> str:
    """The signature of one manifest's exact bytes: keyed by their digest, so writing it
    never overwrites the signature of other bytes (a racing or crashed publish)."""
    if not _HEX.match(manifest_sha256):
        raise InputError(f"digest '{manifest_sha256}'", "not a sha256 hex digest", None)
    return f"{signatures_prefix(model, version)}{manifest_sha256}.json"


def signatures_prefix(model: str, version: str) -> str:
    return f"models/{_check('model', model)}/signatures/{_check('version', version)}/"


def channel_key(model: str, channel: str) -> str:
    return f"models/{_check('model', model)}/channels/{_check('channel', channel)}.json"


def channels_prefix(model: str) -> str:
    return f"models/{_check('model', model)}/channels/"


def cache_key(key: str) -> str:
    if not _HEX.match(key):
        raise InputError(f"cache key '{key}'", "not a sha256 hex digest", None)
    return f"cache/{key}.json"


# Where releases go and come from when neither a config nor --store names a store.
DEFAULT_STORE = "artifacts"
MODELS_PREFIX = "models/"
CACHE_PREFIX = "cache/"
BLOBS_PREFIX = "blobs/sha256/"
