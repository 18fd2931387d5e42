"""Local file helpers: every write a user may later read goes through a temporary name."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; files a user later reads get the usual 0666 & ~umask.
FILE_MODE = 0o666 & ~_umask()


@contextmanager
def atomic_writer(path: Path, mode: str = "wb") -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path``; rename it over ``path`` only on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".incomplete", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_create(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data`` only if absent (FileExistsError otherwise).

    The bytes go to a temporary file first; ``os.link`` then publishes them in one step and
    refuses to replace an existing file, so readers never see a partial file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".incomplete", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_writer(path, "w") as f:
        f.write(text)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_writer(path, "wb") as f:
        f.write(data)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
