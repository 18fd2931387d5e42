"""A file's ref: its path, sha256, size and part digests, as manifests and cache entries name it.

A ref carries the whole-file sha256 (the blob's name) and, since manifest schema 2, the
sha256 of each fixed-size part (``part_size`` bytes; the last part may be shorter). Part
digests let ``pull`` check every range on the thread that fetched it and re-fetch only a bad
part; they are the same SHA-256 checksums the S3 store sends with each multipart upload part.

Since schema 3 a ref also carries each part's BLAKE3 digest, and ``pull`` checks a part by
it where the ref has one (``part_matches``): BLAKE3 costs a quarter to a third of SHA-256's
CPU per byte (even with SHA-NI), and on a node that lands GB/s hashing is the pull's largest
CPU cost (docs/pull.md, "Why BLAKE3 for the parts"). It is as strong for this use: the signed
manifest names the digest, and BLAKE3's 128-bit security (second preimage included) is no
less than the release signature's own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import blake3
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# 16 MiB: above S3's 5 MiB minimum multipart part, a request large enough to amortise its
# round trip, small enough that concurrency x part stays a few hundred MiB; 10,000 parts
# (S3's maximum) cover 160 GiB.
PART_SIZE = 16 << 20
READ = 1 << 20


class FileRef(BaseModel):
    """One file of a bucket (or of the release): its relative path, digest and size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="relative path inside the bucket directory, '/'-separated")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    part_size: int | None = Field(default=None, gt=0)
    parts: list[str] | None = Field(default=None, description="sha256 of each part, in order")
    parts_blake3: list[str] | None = Field(
        default=None, description="BLAKE3 of each part, in order (schema 3)"
    )

    @model_validator(mode="after")
    def _parts_cover_the_file(self) -> FileRef:
        if (self.parts is None) != (self.part_size is None):
            raise ValueError("part_size and parts go together")
        if self.parts is not None and self.part_size is not None:
            want = -(-self.size // self.part_size)
            if len(self.parts) != want:
                raise ValueError(f"{len(self.parts)} part digests for {want} parts")
            for p in (*self.parts, *(self.parts_blake3 or ())):
                if len(p) != 64 or p.strip("0123456789abcdef"):
                    raise ValueError("a part digest is not a 256-bit hex digest")
        if self.parts_blake3 is not None and len(self.parts_blake3) != len(self.parts or ()):
            raise ValueError("parts_blake3 needs one digest for each of parts")
        return self

    @model_serializer(mode="wrap")
    def _omit_absent_parts(self, handler: Any) -> dict[str, Any]:
        # A ref without part digests serialises exactly as schema 1 wrote it.
        data = handler(self)
        if self.parts is None:
            data.pop("part_size", None)
            data.pop("parts", None)
        if self.parts_blake3 is None:  # and without BLAKE3 digests as schema 2 wrote it
            data.pop("parts_blake3", None)
        return data

    def part_range(self, index: int) -> tuple[int, int]:
        """(offset, length) of part ``index``."""
        assert self.part_size is not None
        start = index * self.part_size
        return start, min(self.part_size, self.size - start)

    @property
    def part_hash(self) -> str:
        """The digest ``pull`` checks each part by: blake3 where the ref has it, else sha256."""
        return "blake3" if self.parts_blake3 is not None else "sha256"


def part_matches(ref: FileRef, index: int, data: Any) -> bool:
    """Whether ``data`` (bytes-like) is part ``index`` of ``ref``, by ``ref.part_hash``.
    Both hashes release the GIL on large inputs, so threads hash in parallel."""
    hasher = part_hasher(ref)
    hasher.update(data)
    return hasher.hexdigest() == part_digest(ref, index)


def part_hasher(ref: FileRef) -> Any:
    """A new hasher of ``ref.part_hash``, fed a part piece by piece (``update``)."""
    if ref.parts_blake3 is not None:
        return blake3.blake3()  # one thread: the pull's threads are the parallelism
    return hashlib.sha256()


def part_digest(ref: FileRef, index: int) -> str:
    """The hex digest part ``index`` must have, by ``ref.part_hash``."""
    digests = ref.parts_blake3 if ref.parts_blake3 is not None else ref.parts
    assert digests is not None
    return digests[index]


def _digests(
    path: Path, part_size: int, blake3_parts: bool = True
) -> tuple[str, int, list[str], list[str]]:
    """(whole-file sha256, size, sha256 of each part, BLAKE3 of each part, or none without
    ``blake3_parts``): one read of the file."""
    whole = hashlib.sha256()
    parts: list[str] = []
    parts_blake3: list[str] = []
    size = 0
    with open(path, "rb") as f:
        while True:
            part = hashlib.sha256()
            part3 = blake3.blake3() if blake3_parts else None
            left = part_size
            while left and (chunk := f.read(min(READ, left))):
                whole.update(chunk)
                part.update(chunk)
                if part3 is not None:
                    part3.update(chunk)
                left -= len(chunk)
                size += len(chunk)
            if left == part_size:
                break
            parts.append(part.hexdigest())
            if part3 is not None:
                parts_blake3.append(part3.hexdigest())
    return whole.hexdigest(), size, parts, parts_blake3


def hash_file(path: Path, part_size: int = PART_SIZE) -> tuple[str, int, list[str]]:
    """(whole-file sha256, size, sha256 of each part) in one read of the file."""
    digest, size, parts, _ = _digests(path, part_size, blake3_parts=False)
    return digest, size, parts


def file_ref(path: Path, rel_path: str, part_size: int = PART_SIZE) -> FileRef:
    """The ref of a local file, with part digests (sha256 and BLAKE3): its digest and size,
    named ``rel_path``."""
    digest, size, parts, parts_blake3 = _digests(path, part_size)
    return FileRef(
        path=rel_path,
        sha256=digest,
        size=size,
        part_size=part_size,
        parts=parts,
        parts_blake3=parts_blake3,
    )
