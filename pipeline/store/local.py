"""A store in a local directory (the default, ``artifacts/``)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline._files import atomic_create, atomic_writer
from pipeline.errors import AlreadyExistsError, ConflictError, InputError, NotFoundError
from pipeline.store.base import ObjectInfo, Store

if TYPE_CHECKING:
    from pipeline.store.refs import FileRef

_SKIP = (".incomplete", ".lock")  # temporary files and CAS locks are never keys
LOCK_TIMEOUT_S = 10.0


class LocalStore(Store):
    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.url = str(self.root)
        # A store that does not exist yet is an empty one (publish creates it); a file at
        # or above its path can never become one.
        for p in (self.root, *self.root.parents):
            if p.exists():
                if not p.is_dir():
                    raise InputError(
                        f"store {root}",
                        f"{p} is a file, not a directory",
                        "give a directory, file://PATH or s3://BUCKET/PREFIX to --store",
                    )
                break

    @classmethod
    def from_url(cls, url: str, **_: object) -> LocalStore:
        return cls(Path(url.removeprefix("file://")))

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root not in path.parents or path.name.endswith(_SKIP):
            raise InputError(key, "not a valid store key", "use a relative key")
        return path

    def _missing(self, key: str) -> NotFoundError:
        return NotFoundError(f"{self.url}/{key}", "not found in the store", None)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise self._missing(key) from None

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> None:
        path = self._path(key)
        if if_match is not None:
            self._compare_and_swap(path, key, data, if_match)
            return
        if not if_absent:
            with atomic_writer(path) as f:
                f.write(data)
            return
        try:
            atomic_create(path, data)  # os.link: refuses to replace, readers never see half
        except FileExistsError:
            raise AlreadyExistsError(f"{self.url}/{key}", "already exists", None) from None

    def _compare_and_swap(self, path: Path, key: str, data: bytes, expected: str) -> None:
        # flock (not an O_EXCL lock file) so a writer killed mid-swap never wedges the key:
        # the kernel drops the lock with the process. The version tag is the content digest.
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            _flock(lock, key)
            current = self.get_versioned(key)
            if (current[1] if current else "") != expected:
                raise ConflictError(key, "changed since it was read", "re-read and retry")
            with atomic_writer(path) as f:
                f.write(data)

    def put_file(self, key: str, path: Path, *, ref: FileRef | None = None) -> None:
        with atomic_writer(self._path(key)) as f, open(path, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)

    def get_file(self, key: str, dest: Path) -> None:
        try:
            src = open(self._path(key), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise self._missing(key) from None
        with src, atomic_writer(Path(dest)) as f:
            shutil.copyfileobj(src, f, 1 << 20)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(length)
        except FileNotFoundError:
            raise self._missing(key) from None

    def read_range_into(self, key: str, start: int, buf: memoryview) -> int:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise self._missing(key) from None
        try:
            got = 0
            while got < len(buf):  # preadv may return less than asked (signals, huge reads)
                n = os.preadv(fd, [buf[got:]], start + got)
                if not n:
                    break
                got += n
            return got
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        with contextlib.suppress(FileNotFoundError):
            return self._path(key).stat().st_size
        return None

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        base = (self.root / prefix).resolve() if prefix else self.root
        if base != self.root and self.root not in base.parents:
            raise InputError(prefix, "not a valid store prefix", "use a relative prefix")
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.endswith(_SKIP):
                    continue
                path = Path(dirpath, name)
                with contextlib.suppress(FileNotFoundError):  # deleted while we walked
                    st = path.stat()
                    yield ObjectInfo(
                        path.relative_to(self.root).as_posix(), st.st_size, st.st_mtime
                    )

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def local_path(self, key: str) -> Path | None:
        path = self._path(key)
        return path if path.is_file() else None

    def cleanup_incomplete(self, older_than_s: float) -> int:
        """Remove temporary files that a killed writer left behind (``*.incomplete``)."""
        cutoff, removed = time.time() - older_than_s, 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                path = Path(dirpath, name)
                with contextlib.suppress(FileNotFoundError):
                    if name.endswith(".incomplete") and path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
        return removed


def _flock(f, key: str) -> None:
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ConflictError(key, "another writer holds the lock", "retry") from None
            time.sleep(0.01)
