"""The small interface every store backend implements; everything else builds on it.

Keys are ``/``-separated paths relative to the store root (``blobs/sha256/<hex>``,
``models/<m>/releases/<v>.json``, ``cache/<key>.json``). Values are bytes or files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path


class Store(ABC):
    url: str

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Raise NotFoundError when absent."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(data, version tag) for compare-and-swap, or None when absent."""

    @abstractmethod
    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> None:
        """Write atomically. ``if_absent``: AlreadyExistsError when present.
        ``if_match``: ConflictError unless the current version tag equals it."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file atomically (multipart and concurrent for large files)."""

    @abstractmethod
    def get_file(self, key: str, dest: Path) -> None:
        """Download to ``dest`` through a temporary name; NotFoundError when absent."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from offset ``start`` (a ranged GET); NotFoundError when absent."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Size in bytes, or None when absent."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix`` (a folder path ending in ``/``), in no set order."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove; absent keys are fine."""
