"""The small interface every store backend implements; everything else builds on it.

Keys are ``/``-separated paths relative to the store root (``blobs/sha256/<hex>``,
``models/<m>/releases/<v>.json``, ``cache/<key>.json``). Values are bytes or files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.store.refs import FileRef


# Takes each piece of a range as it comes, and its offset in the object (``read_range_through``).
RangeSink = Callable[[memoryview, int], None]


@dataclass(frozen=True)
class ObjectInfo:
    """One listed key: its size and last-modified time (seconds since the epoch, UTC)."""

    key: str
    size: int
    mtime: float


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
    def put_file(self, key: str, path: Path, *, ref: FileRef | None = None) -> None:
        """Upload a local file atomically (multipart and concurrent for large files).
        ``ref``: the file's digests, which a backend that checks uploads (S3) sends along."""

    @abstractmethod
    def get_file(self, key: str, dest: Path) -> None:
        """Download to ``dest`` through a temporary name; NotFoundError when absent."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from offset ``start`` (a ranged GET); NotFoundError when absent.
        Fewer bytes (or none) come back where the object ends sooner."""

    def read_range_into(self, key: str, start: int, buf: memoryview) -> int:
        """``get_range`` into ``buf``: reads ``len(buf)`` bytes from offset ``start`` and
        returns how many, fewer (or 0) where the object ends sooner; NotFoundError when
        absent. Backends override it to fill ``buf`` without an intermediate copy."""
        data = self.get_range(key, start, len(buf))
        buf[: len(data)] = data
        return len(data)

    def read_range_through(
        self, key: str, start: int, length: int, chunk: memoryview, sink: RangeSink
    ) -> int:
        """Read ``length`` bytes from offset ``start`` through ``chunk``, a small buffer:
        each time it is filled (the last time, with what is left), ``sink(piece, offset)``
        gets it before the next read. Returns the bytes that came, fewer where the object
        ends sooner. Here one ``read_range_into`` a chunk; a backend whose reads are
        requests reads the range in one (``streams_ranges``)."""
        if not len(chunk):
            raise ValueError("read_range_through needs a chunk of at least one byte")
        got = 0
        while got < length:
            piece = chunk[: min(len(chunk), length - got)]
            n = self.read_range_into(key, start + got, piece)
            if n:
                sink(piece[:n], start + got)
            got += n
            if n < len(piece):
                break
        return got

    def streams_ranges(self) -> bool:
        """Whether a pull should land a range through a small buffer as it comes
        (``read_range_through``), not read it whole first: where every read brings one
        TLS record anyway, so a small buffer costs no extra reads, and a MiB hashed and
        written while in the CPU's cache crosses memory fewer times."""
        return False

    def pull_processes(self, cpus: int) -> int:
        """How many worker processes a pull on ``cpus`` CPUs should land ranges in: one,
        unless this store's reads take the GIL back often enough to bind one process (TLS
        in Python: ``pipeline.install.processes``)."""
        return 1

    def after_fork(self) -> None:
        """Called in a forked worker process before its first read: drop what it would
        otherwise share with its parent (pooled connections)."""
        return None

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Size in bytes, or None when absent."""

    @abstractmethod
    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        """Keys under ``prefix`` (a folder path ending in ``/``) with size and mtime,
        in no set order."""

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix`` (a folder path ending in ``/``), in no set order."""
        return (info.key for info in self.list_info(prefix))

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove; absent keys are fine."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Remove several keys (backends may batch); absent keys are fine."""
        for key in keys:
            self.delete(key)

    def local_path(self, key: str) -> Path | None:
        """A local file holding the key's bytes, when the store is on this machine."""
        return None

    def cleanup_incomplete(self, older_than_s: float) -> int:
        """Remove leftovers of interrupted uploads older than ``older_than_s`` (temporary
        files, unfinished multipart uploads); returns how many. They are never visible
        as keys, only storage."""
        return 0

    def principal(self) -> str | None:
        """Who the store sees us as (an IAM ARN), when that is cheap to learn; else None."""
        return None
