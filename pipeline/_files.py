"""Local file helpers: every write a user may later read goes through a temporary name."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import InputError, PipelineError

CHUNK = 1 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; files a user later reads get the usual 0666 & ~umask.
FILE_MODE = 0o666 & ~_umask()


@contextmanager
def atomic_writer(
    path: Path, mode: str = "wb", *, file_mode: int = FILE_MODE
) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path``; rename it over ``path`` only on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _mkstemp(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode)
        os.replace(tmp, path)
    except OSError as e:
        raise _naming(e, path, tmp) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_create(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data`` only if absent (FileExistsError otherwise).

    The bytes go to a temporary file first; ``os.link`` then publishes them in one step and
    refuses to replace an existing file, so readers never see a partial file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _mkstemp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.link(tmp, path)
    except OSError as e:
        raise _naming(e, path, tmp) from e
    finally:
        os.unlink(tmp)


def _mkstemp(path: Path) -> tuple[int, str]:
    try:
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".incomplete", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e


# Errors of writing a file's bytes; they carry no file name when raised by write or close.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})


def _naming(e: OSError, path: Path, tmp: str) -> OSError:
    """``e`` about ``path``, the file the caller asked for, rather than the temporary file
    (whose name means nothing to a user and is gone by the time they read it). An error
    about another file (a source read inside the ``with``) is left as it is."""
    if e.filename == tmp or (e.filename is None and e.errno in _DISK_ERRNOS):
        return OSError(e.errno, e.strerror, str(path))  # the subclass that errno selects
    return e


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_writer(path, "w") as f:
        f.write(text)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = FILE_MODE) -> None:
    with atomic_writer(path, "wb", file_mode=mode) as f:
        f.write(data)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# errno values a user fixes by choosing another path or changing one (permissions, a file
# where a directory should be): bad input, exit 2. Others (ENOSPC, EIO) are the outside
# world's: exit 1.
USER_PATH_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.ENAMETOOLONG,
        errno.ELOOP,
    }
)
# Names of this tool's own temporary files and directories (here, tiny_model, gqa_pad,
# install.pull): never shown to a user, who named only what is above them.
_INTERNAL_NAME = re.compile(r"^\.(staging-|replaced-|current\.)|^\..*\.incomplete$")


def path_error(
    e: OSError, given: Path | str | None = None, option: str | None = None
) -> PipelineError:
    """The one-line error for an OSError about a local path.

    It names ``given`` (the path the user passed, shown as ``option given``) when the
    failure is at or under it, else the failing path less any temporary names of ours; says
    which existing path is in the way; exit 2 for what the user can fix (``USER_PATH_ERRNOS``,
    with a file name), exit 1 otherwise (a full disk, an I/O error).
    """
    why = (e.strerror or str(e) or type(e).__name__).lower()
    name = e.filename
    if not isinstance(name, str | os.PathLike):
        return PipelineError("I/O", why, None)
    failed = user_visible(Path(name))
    label = option or "path"
    if given is not None and within(Path(name), Path(given)):
        what = f"{option} {given}" if option else str(given)
    else:
        what = str(failed)
    if e.errno not in USER_PATH_ERRNOS:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        return PipelineError(
            what, why, f"free some space, or choose another {label}" if full else None
        )
    raw = Path(name)
    blocker = user_visible(_nearest_existing(raw))
    creating = not os.path.lexists(raw)
    if not creating and raw.is_file() and not os.access(raw.parent, os.W_OK):
        creating, blocker = True, raw.parent  # replacing a file needs its directory writable
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and not blocker.is_dir():
        why, hint = f"{why}: {blocker} is a file", f"remove {blocker}, or choose another {label}"
    elif e.errno in (errno.EACCES, errno.EPERM) and creating:
        why = f"{why}: cannot write in {blocker}"
        hint = f"make {blocker} writable, or choose another {label}"
    elif e.errno in (errno.EACCES, errno.EPERM):
        why = f"{why}: {failed}" if what != str(failed) else why
        hint = f"check the permissions of {failed}"
    elif e.errno == errno.EROFS:
        hint = f"choose a {label} on a writable file system"
    elif e.errno == errno.EISDIR:
        why, hint = f"{why}: {failed}", f"remove the directory {failed}, or choose another {label}"
    elif e.errno == errno.EEXIST:
        why, hint = f"{why}: {failed}", f"choose another {label}"
    elif e.errno == errno.ENAMETOOLONG:
        hint = f"choose a shorter {label}"
    else:  # ELOOP
        hint = f"fix the symbolic links in {failed}"
    return InputError(what, why, hint)


def user_visible(path: Path) -> Path:
    """``path`` up to (not including) its first component that is a temporary name of ours."""
    parts = path.parts
    for i, part in enumerate(parts):
        if _INTERNAL_NAME.search(part):
            return Path(*parts[:i]) if i else Path(".")
    return path


def _nearest_existing(path: Path) -> Path:
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return p
    return Path(".")


def within(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or under it (both made absolute, not resolved)."""
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(root))
