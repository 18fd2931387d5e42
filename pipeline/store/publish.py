"""Publish: the store's protocol for making a release immutable and complete.

1. Upload only the blobs the destination lacks, concurrently (the S3 store uploads a blob
   with part digests as a multipart upload whose parts are the manifest's parts, each with
   its SHA-256, so S3 checks every part). Republishing unchanged content uploads nothing.
2. Check once more that every blob the manifest names is there, then write the manifest
   last, with a conditional create (``If-None-Match: *`` in S3, ``link`` locally).

A crash before step 2 leaves only unreferenced blobs (``gc`` collects them); a crash after it
leaves a complete release. An existing version is never overwritten: publishing different
content under it fails; publishing the same content again is a no-op (a re-run after a
crash succeeds). Assembling the manifest from a config is the compile stage's job
(``pipeline.compile.release``); this module knows only manifests, blobs and stores.
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

from pipeline._files import sha256_file
from pipeline.contracts.store_layout import blob_key, release_key
from pipeline.errors import (
    AlreadyExistsError,
    InputError,
    IntegrityError,
    NotFoundError,
)
from pipeline.store.base import Store
from pipeline.store.manifest import Manifest, parse_manifest
from pipeline.store.refs import FileRef
from pipeline.store.signing import (
    Signer,
    Trust,
    check,
    manifest_digest,
    read_signature,
    sign_manifest,
    write_signature,
)

# Where a blob's bytes come from: a local file, or a store that holds blobs/sha256/<hex>.
BlobSource = Path | Store
ProgressFn = Callable[[int], None]
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
    signed_by: str | None = None  # the signing key's id

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_version(manifest: Manifest, now: datetime | None = None) -> str:
    """UTC date plus a short digest of the content: ``20250101-1a2b3c4d``."""
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%d}-{manifest.content_digest()[:8]}"


def publish(
    dest: Store,
    manifest: Manifest,
    sources: Mapping[str, BlobSource],
    *,
    version: str | None = None,
    jobs: int = DEFAULT_JOBS,
    progress: ProgressFn | None = None,
    signer: Signer | None = None,
) -> PublishResult:
    """Upload the blobs ``dest`` lacks, then create the manifest if absent. ``signer``: sign
    the manifest's bytes, storing the signature before the manifest, so a signed release is
    never seen unsigned (the signature is keyed by the bytes' digest: it overwrites nothing).
    Publishing the same content again signs the stored manifest if it is not yet signed."""
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
            signed_by=signer.key_id if signer else None,
        )

    # Fail before uploading gigabytes when the version is taken by other content.
    if _same_release_exists(dest, manifest, key):
        _sign_existing(dest, manifest, key, signer)
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
    data = manifest.to_bytes()
    if signer is not None:
        write_signature(
            dest, manifest.model, version, sign_manifest(signer, manifest.model, version, data)
        )
    try:
        dest.put_bytes(key, data, if_absent=True)
    except AlreadyExistsError:
        if _same_release_exists(dest, manifest, key):
            _sign_existing(dest, manifest, key, signer)
            return result(created=False, uploaded=uploader.counts())
        raise
    return result(created=True, uploaded=uploader.counts())


def sign_release(
    dest: Store, model: str, version: str, signer: Signer, *, replace: bool = False
) -> bool:
    """Sign the stored manifest of ``model`` ``version`` (a release published unsigned, or
    one re-signed by a new key with ``replace``). False when ``signer`` had signed it already."""
    data = dest.get_bytes(release_key(model, version))
    parse_manifest(data, f"{dest.url}/{release_key(model, version)}")
    return _sign_bytes(dest, model, version, data, signer, replace=replace)


def _sign_existing(dest: Store, manifest: Manifest, key: str, signer: Signer | None) -> None:
    if signer is not None:
        _sign_bytes(dest, manifest.model, manifest.version, dest.get_bytes(key), signer)


def _sign_bytes(
    dest: Store, model: str, version: str, data: bytes, signer: Signer, *, replace: bool = False
) -> bool:
    existing = read_signature(dest, model, version, manifest_digest(data))
    if existing is not None:
        if existing.key_id == signer.key_id:
            mine = Trust({signer.key_id: signer.public_key})
            if check(existing, model, version, data, mine) == "trusted":
                return False  # already signed by this key
        # a valid signature by another key stays unless replaced; an invalid one is overwritten
        elif not replace and check(existing, model, version, data, None) == "untrusted":
            raise AlreadyExistsError(
                f"release {model} {version}",
                f"already signed by key {existing.short_id}",
                "pass --replace to sign it with this key instead",
            )
    write_signature(dest, model, version, sign_manifest(signer, model, version, data))
    return True


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
            self.dest.put_file(key, source, ref=ref)
        elif (local := source.local_path(key)) is not None:
            _verify(local, ref, source.url)
            self.dest.put_file(key, local, ref=ref)
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
                self.dest.put_file(key, path, ref=ref)
        with self._lock:
            self._files += 1
            self._bytes += ref.size
        if self.progress:
            self.progress(ref.size)


def _verify(path: Path, ref: FileRef, where: str) -> None:
    """Never republish corrupted bytes: the digest is the blob's name."""
    digest, size = sha256_file(path), path.stat().st_size  # no part digests: not needed here
    if (digest, size) != (ref.sha256, ref.size):
        raise IntegrityError(
            f"blob {ref.sha256[:12]} ({ref.path}) in {where}",
            f"content does not match its digest (got {digest[:12]}, {size} bytes)",
            "delete the blob and recompile",
        )
