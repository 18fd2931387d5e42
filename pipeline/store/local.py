"""A store in a local directory (the default, ``artifacts/``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from pipeline._files import atomic_create, atomic_writer
from pipeline.errors import AlreadyExistsError, ConflictError, InputError, NotFoundError
from pipeline.store.base import Store


class LocalStore(Store):
    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.url = str(self.root)

    @classmethod
    def from_url(cls, url: str, **_: object) -> LocalStore:
        return cls(Path(url.removeprefix("file://")))

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root not in path.parents:
            raise InputError(key, "store key escapes the store root", "use a relative key")
        return path

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}/{key}", "not found in the store", None) from None

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
            atomic_create(path, data)
        except FileExistsError:
            raise AlreadyExistsError(f"{self.url}/{key}", "already exists", None) from None

    def _compare_and_swap(self, path: Path, key: str, data: bytes, expected: str) -> None:
        # A lock file serialises writers; the version tag is the content digest.
        lock = path.with_name(path.name + ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            raise ConflictError(key, "another writer holds the lock", "retry") from None
        try:
            current = self.get_versioned(key)
            tag = current[1] if current else ""
            if tag != expected:
                raise ConflictError(key, "changed since it was read", "re-read and retry")
            with atomic_writer(path) as f:
                f.write(data)
        finally:
            os.close(fd)
            os.unlink(lock)

    def put_file(self, key: str, path: Path) -> None:
        with atomic_writer(self._path(key)) as f, open(path, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)

    def get_file(self, key: str, dest: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFoundError(f"{self.url}/{key}", "not found in the store", None)
        with atomic_writer(Path(dest)) as f, open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 20)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(length)
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}/{key}", "not found in the store", None) from None

    def size(self, key: str) -> int | None:
        with contextlib.suppress(FileNotFoundError):
            return self._path(key).stat().st_size
        return None

    def list(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.endswith((".incomplete", ".lock")):
                    continue
                yield Path(dirpath, name).relative_to(self.root).as_posix()

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()
