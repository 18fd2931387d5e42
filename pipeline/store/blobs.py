"""Content-addressed files: ``blobs/sha256/<hex>``, shared by every release and cache entry."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pipeline._files import sha256_file
from pipeline.store.base import Store
from pipeline.store.layout import blob_key


class FileRef(BaseModel):
    """One file of a bucket (or of the release): its relative path, digest and size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="relative path inside the bucket directory, '/'-separated")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


def put_blob(store: Store, local: Path, rel_path: str) -> tuple[FileRef, bool]:
    """Upload ``local`` unless the store already has its bytes. Returns (ref, uploaded)."""
    digest = sha256_file(local)
    size = local.stat().st_size
    key = blob_key(digest)
    uploaded = store.size(key) != size
    if uploaded:
        store.put_file(key, local)
    return FileRef(path=rel_path, sha256=digest, size=size), uploaded


def get_blob(store: Store, ref: FileRef, dest: Path) -> None:
    """Download a blob to ``dest`` (through a temporary name)."""
    store.get_file(blob_key(ref.sha256), dest)


def file_ref(path: Path, rel_path: str) -> FileRef:
    """The ref of a local file: its digest and size, named ``rel_path``."""
    return FileRef(path=rel_path, sha256=sha256_file(path), size=path.stat().st_size)
