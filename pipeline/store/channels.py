"""Channels, ``models/<m>/channels/<c>.json``: small movable pointers to a release.

``promote`` moves a pointer with compare-and-swap (``If-Match`` on the ETag in S3, a digest
check under a lock locally), refuses a version that does not exist, and records who moved it,
when, and from which version, with a short history for rollbacks.
"""

from __future__ import annotations

import getpass
import random
import socket
import time
from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.contracts.store_layout import channel_key, channels_prefix
from pipeline.errors import (
    AlreadyExistsError,
    ConflictError,
    ManifestError,
)
from pipeline.store.base import Store
from pipeline.store.manifest import first_problem, json_object, read_release_bytes
from pipeline.store.signing import Trust, manifest_digest, verify_in_store

CHANNEL_SCHEMA = 1
HISTORY = 20  # moves kept in the pointer file
CAS_ATTEMPTS = 10


class Move(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    version: str
    previous: str | None = None
    by: str
    at: str  # ISO 8601, UTC
    principal: str | None = None  # the AWS identity, when the store is S3
    manifest_sha256: str | None = None  # the exact manifest moved to (None: before 0.x)


class Channel(BaseModel):
    """The pointer file. Readers need only ``version`` (pull reads nothing else)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: int = CHANNEL_SCHEMA
    model: str
    channel: str
    version: str
    previous: str | None = None
    by: str
    at: str
    principal: str | None = None
    # sha256 of the manifest's stored bytes: the pointer names exactly one manifest, and
    # pull refuses a release whose manifest is not those bytes (pointers written before
    # this field hold none; where a key is trusted, pull refuses those too)
    manifest_sha256: str | None = None
    history: list[Move] = []  # newest first, the current move included


def read_channel(store: Store, model: str, channel: str) -> Channel | None:
    got = store.get_versioned(channel_key(model, channel))
    return None if got is None else _parse(store, model, channel, got[0])


def _parse(store: Store, model: str, channel: str, data: bytes) -> Channel:
    """A malformed pointer is one line naming the field, exit 2: it is written atomically,
    so no retry will find it any different (a pod restarting on it would loop forever)."""
    what = f"channel '{channel}' of model '{model}' ({store.url}/{channel_key(model, channel)})"
    hint = f"re-promote: 'inf2-pipeline promote {model} VERSION --channel {channel}'"
    raw = json_object(data, what, hint)
    # Older or hand-written pointers hold only {"version": ...}.
    raw.setdefault("model", model)
    raw.setdefault("channel", channel)
    raw.setdefault("by", "unknown")
    raw.setdefault("at", "")
    try:
        return Channel.model_validate(raw)
    except ValidationError as e:
        raise ManifestError(what, first_problem(e), hint) from None


def list_channels(store: Store, model: str) -> dict[str, Channel]:
    prefix = channels_prefix(model)
    out = {}
    for key in store.list(prefix):
        name = key[len(prefix) :]
        if name.endswith(".json") and "/" not in name:
            ch = read_channel(store, model, name[: -len(".json")])
            if ch is not None:
                out[ch.channel] = ch
    return out


def whoami() -> str:
    """user@host from the environment (never a secret)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _check_release(store: Store, model: str, version: str, trust: Trust | None) -> str:
    """The release exists, its manifest reads (and, with ``trust``, is signed by a trusted
    key): a channel must never point at a release that no pod could pull. Returns the
    sha256 of the manifest's bytes."""
    _, data = read_release_bytes(store, model, version)
    if trust is not None:
        verify_in_store(store, model, version, data, trust)
    return manifest_digest(data)


def promote(
    store: Store,
    model: str,
    version: str,
    channel: str,
    *,
    by: str | None = None,
    trust: Trust | None = None,
) -> Channel:
    """Point ``channel`` at an existing release; compare-and-swap, retried on a lost race.
    ``trust``: refuse a release that pods trusting those keys would refuse."""
    digest = _check_release(store, model, version, trust)
    by = by or whoami()
    principal = store.principal()
    key = channel_key(model, channel)
    for attempt in range(CAS_ATTEMPTS):
        got = store.get_versioned(key)
        current = None if got is None else _parse(store, model, channel, got[0])
        move = Move(
            version=version,
            previous=current.version if current else None,
            by=by,
            at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            principal=principal,
            manifest_sha256=digest,
        )
        new = Channel(
            model=model,
            channel=channel,
            **move.model_dump(),
            history=[move, *(current.history if current else [])][:HISTORY],
        )
        data = new.model_dump_json(indent=2).encode()
        try:
            if got is None:
                store.put_bytes(key, data, if_absent=True)
            else:
                store.put_bytes(key, data, if_match=got[1])
            return new
        except (ConflictError, AlreadyExistsError):
            # Someone else moved it: re-read and retry, after a jittered pause.
            time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))
    raise ConflictError(
        f"channel '{channel}' of model '{model}'",
        f"moved by others {CAS_ATTEMPTS} times while we tried",
        "retry",
    )
