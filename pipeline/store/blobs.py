"""Content-addressed files: ``blobs/sha256/<hex>``, shared by every release and cache entry
(each named by its ref, ``pipeline.store.refs``)."""

from __future__ import annotations

from pathlib import Path

from pipeline.contracts.store_layout import blob_key
from pipeline.store.base import Store
from pipeline.store.refs import PART_SIZE, FileRef, file_ref, hash_file


def put_blob(
    store: Store, local: Path, rel_path: str, part_size: int | None = PART_SIZE
) -> tuple[FileRef, bool]:
    """Upload ``local`` unless the store already has its bytes. Returns (ref, uploaded).
    ``part_size=None``: a ref without part digests (as manifest schema 1 wrote them)."""
    if part_size is None:
        digest, size, _ = hash_file(local)
        ref = FileRef(path=rel_path, sha256=digest, size=size)
    else:
        ref = file_ref(local, rel_path, part_size)
    key = blob_key(ref.sha256)
    uploaded = store.size(key) != ref.size
    if uploaded:
        store.put_file(key, local, ref=ref)
    return ref, uploaded


def get_blob(store: Store, ref: FileRef, dest: Path) -> None:
    """Download a blob to ``dest`` (through a temporary name)."""
    store.get_file(blob_key(ref.sha256), dest)
