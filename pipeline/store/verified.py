"""Reading a release the way a pod must: the channel pointer's manifest digest, then the
manifest's signature against the trusted keys, and only then the manifest itself.

``pull`` installs nothing it did not get from here; ``promote --trust`` refuses what it
would refuse. With no trusted key nothing is verified but the pointer's digest (a pointer
that names other bytes than the stored manifest is refused in any case).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.contracts.store_layout import release_key
from pipeline.errors import VerificationError
from pipeline.store.base import Store
from pipeline.store.manifest import Manifest, parse_release, read_manifest_bytes
from pipeline.store.releases import resolve_pointer
from pipeline.store.signing import (
    Signature,
    Status,
    Trust,
    check,
    manifest_digest,
    other_signatures,
    read_signature,
    verify,
)


@dataclass(frozen=True)
class VerifiedRelease:
    manifest: Manifest
    data: bytes  # the manifest's stored bytes, installed verbatim
    signature: Signature | None  # as stored (verified when ``trusted``)
    trusted: bool  # verified against a trusted key


def read_verified(
    store: Store,
    model: str,
    *,
    version: str | None = None,
    channel: str | None = None,
    trust: Trust | None = None,
) -> VerifiedRelease:
    version, pointer = resolve_pointer(store, model, version, channel)
    data = read_manifest_bytes(store, model, version)
    digest = manifest_digest(data)
    if pointer is not None:
        where = f"channel '{channel}' of model '{model}'"
        if pointer.manifest_sha256 is None and trust is not None:
            raise VerificationError(
                where,
                f"names release {version} but no manifest digest (an older promote wrote it)",
                f"re-promote: 'inf2-pipeline promote {model} {version} --channel {channel}'",
            )
        if pointer.manifest_sha256 not in (None, digest):
            raise VerificationError(
                where,
                f"names manifest sha256 {pointer.manifest_sha256[:16]} of release {version}, "
                f"but the stored manifest is {digest[:16]}",
                "the manifest was replaced or the pointer edited; re-promote a release you trust",
            )
    sig = read_signature(store, model, version, digest)
    if trust is not None:
        others = other_signatures(store, model, version, digest) if sig is None else []
        verify(sig, model, version, data, trust, others=others)
    what = f"release {model} {version} ({store.url}/{release_key(model, version)})"
    manifest = parse_release(data, what, model, version)
    return VerifiedRelease(manifest, data, sig, trusted=trust is not None)


@dataclass(frozen=True)
class SignatureInfo:
    """Who signed a stored release and whether it verifies (``list``, ``show``, ``diff``)."""

    key_id: str | None
    signer: str | None
    status: Status

    def to_dict(self) -> dict[str, str | None]:
        return {"key_id": self.key_id, "signer": self.signer, "status": self.status}

    def line(self) -> str:
        if self.key_id is None:
            return "unsigned"
        return f"{self.key_id[:16]} ({self.status})"


def signature_info(store: Store, model: str, version: str, trust: Trust | None) -> SignatureInfo:
    data = read_manifest_bytes(store, model, version)
    sig = read_signature(store, model, version, manifest_digest(data))
    status = check(sig, model, version, data, trust)
    return SignatureInfo(sig.key_id if sig else None, sig.signer if sig else None, status)
