"""Landing one range: fetched from the store into this thread's buffer, each manifest part
checked there against its digest (BLAKE3 where the manifest has it, else sha256; a bad one
fetched again, alone), then written at its offset with ``pwrite`` into a preallocated
temporary file; and the retries of a transport error.

Where the store's reads come a TLS record at a time (``Store.streams_ranges``), a range with
part digests is streamed instead: read a MiB at a time into a small buffer, each MiB
written and fed to its part's hasher while it is in the CPU's cache, the parts checked once
the range is in, and a bad one fetched again alone, as above. Bytes are then on disk before
their part is checked, so a killed pull's temporary file may hold unchecked bytes: a resume
checks every part on disk before it keeps one (``_already_there``, a MiB at a time), as it
always did, and streams a range it cannot keep."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pipeline._files import FILE_MODE, user_visible
from pipeline.errors import IntegrityError, PipelineError, StoreError
from pipeline.store.base import Store
from pipeline.store.refs import FileRef, part_digest, part_hasher, part_matches

RETRIES = 6  # transport errors (throttling, 5xx, resets) per request


PART_RETRIES = 3  # re-fetches of one part whose bytes do not match its digest


FILE_RETRIES = 2  # whole-file re-fetches of a file checked only whole


# A streamed range's buffer: about a core's L2 (0.5-2 MiB on current x86 server cores), so the
# hash and the pwrite read it mostly from cache; 64 TLS records, so the Python around each MiB
# is ~1/64 of a read's. 9 % less CPU per GB on 16 cores and 0-8.5 % on 2 than reading each
# 16 MiB range whole first (bench/RESULTS.md, thirty-first and thirty-second rounds).
STREAM_CHUNK = 1 << 20


T = TypeVar("T")


@dataclass(frozen=True)
class RangeJob:
    """One range to land: fetch it, check it, write it at its offset into ``tmp`` (a
    preallocated temporary file)."""

    key: str
    ref: FileRef
    tmp: str
    start: int
    length: int
    whole: bool  # the file is this one range and has no part digests: check it whole
    resume: bool  # keep the range if its parts already on disk match their digests


@dataclass(frozen=True)
class Landed:
    """What landing a range took."""

    got: int = 0  # bytes downloaded, re-fetches included
    resumed: bool = False  # already on disk and verified: nothing downloaded
    refetched_parts: int = 0
    refetched_files: int = 0


def land_range(store: Store, job: RangeJob, open_fd: Callable[[], int]) -> Landed:
    """Land ``job`` into the file ``open_fd()`` returns (asked for once the bytes are in,
    unless resuming: a resumed range whose parts on disk all check out is kept). The range
    is streamed where the store streams (``_land_streamed``); else it is read into this
    thread's buffer, each manifest part is checked against its digest there and written
    from there, and a bad one is fetched again, alone, into its place in the buffer (up to
    ``PART_RETRIES`` times)."""
    ref, key, start, length = job.ref, job.key, job.start, job.length
    if job.resume and _already_there(open_fd(), ref, start, length):
        return Landed(resumed=True)
    if ref.parts is not None and store.streams_ranges():
        return _land_streamed(store, job, open_fd)
    buf = _buffer(length)
    got = _read(store, key, start, buf)
    fd = open_fd()
    fetched, refetched_parts, refetched_files = got, 0, 0
    if ref.parts is not None:
        extra, refetched_parts = _write_parts(store, job, fd, buf, got)
        fetched += extra
    elif job.whole:  # the whole file in memory: check it now, for free
        while got != length or (digest := hashlib.sha256(buf).hexdigest()) != ref.sha256:
            if refetched_files == FILE_RETRIES:
                raise file_mismatch(ref, key, digest if got == length else "short")
            refetched_files += 1
            got = _read(store, key, start, buf)
            fetched += got
        _pwrite(job.tmp, fd, buf, start)
    else:  # checked whole once every range landed; a short range is bad already
        while got != length:
            if refetched_parts == PART_RETRIES:
                raise _short(ref, key, start, length, got)
            refetched_parts += 1
            got = _read(store, key, start, buf)
            fetched += got
        _pwrite(job.tmp, fd, buf, start)
    return Landed(fetched, False, refetched_parts, refetched_files)


def _land_streamed(store: Store, job: RangeJob, open_fd: Callable[[], int]) -> Landed:
    """Land ``job`` through this thread's small buffer (see the module docstring): each
    piece written at its offset and fed to the hashers of the parts it holds as it comes;
    then each part checked, and a bad or short one fetched again alone."""
    ref = job.ref
    assert ref.part_size is not None
    chunk, fd = _chunk(), -1
    hashers: dict[int, Any] = {}
    have: dict[int, int] = {}

    def sink(piece: memoryview, off: int) -> None:
        nonlocal fd
        if fd < 0:  # asked for once the first bytes are in (``land_range``)
            fd = open_fd()
        _pwrite(job.tmp, fd, piece, off)
        while piece:  # the piece by the parts it holds
            i = off // ref.part_size
            part_off, part_n = ref.part_range(i)
            n = min(len(piece), part_off + part_n - off)
            hasher = hashers.get(i)
            if hasher is None:
                hashers[i] = hasher = part_hasher(ref)
            hasher.update(piece[:n])
            have[i] = have.get(i, 0) + n
            piece, off = piece[n:], off + n

    def fetch() -> int:
        hashers.clear()  # a retried range starts again
        have.clear()
        return store.read_range_through(job.key, job.start, job.length, chunk, sink)

    got = with_retries(fetch)
    extra = bad = 0
    for i in _parts_of(ref, job.start, job.length):
        off, n = ref.part_range(i)
        if have.get(i) == n and hashers[i].hexdigest() == part_digest(ref, i):
            continue
        if fd < 0:
            fd = open_fd()
        redo = RangeJob(job.key, ref, job.tmp, off, n, False, False)
        # a buffer of its own, freed after: a thread keeps only its MiB in flight
        more, again = _write_parts(store, redo, fd, memoryview(bytearray(n)), 0)
        extra, bad = extra + more, bad + again
    return Landed(got + extra, False, bad, 0)


_THREAD = threading.local()


def _chunk() -> memoryview:
    """This thread's buffer for streamed ranges (``STREAM_CHUNK`` bytes), allocated once."""
    chunk = getattr(_THREAD, "chunk", None)
    if chunk is None:
        _THREAD.chunk = chunk = memoryview(bytearray(STREAM_CHUNK))
    return chunk


def _buffer(n: int) -> memoryview:
    """This thread's landing buffer, viewed at ``n`` bytes. Allocated once per thread (and
    grown when a longer range comes), so the bytes in memory stay at threads × range size
    however many ranges land, and no range makes a new bytes object."""
    buf = getattr(_THREAD, "buf", None)
    if buf is None or len(buf) < n:
        _THREAD.buf = buf = bytearray(n)
    return memoryview(buf)[:n]


def _parts_of(ref: FileRef, start: int, length: int) -> range:
    assert ref.part_size is not None
    return range(start // ref.part_size, -(-(start + length) // ref.part_size))


def _already_there(fd: int, ref: FileRef, start: int, length: int) -> bool:
    """Whether every part of the range is already on disk with the right digest: read a
    MiB at a time (``_hash_on_disk``), so checking a resumed range holds no more memory
    than streaming one."""
    assert ref.parts is not None and ref.part_size is not None
    for i in _parts_of(ref, start, length):
        hasher = part_hasher(ref)
        if not _hash_on_disk(hasher, fd, *ref.part_range(i)):
            return False
        if hasher.hexdigest() != part_digest(ref, i):
            return False
    return True


def _hash_on_disk(hasher: Any, fd: int, off: int, n: int) -> bool:
    """Feed ``n`` bytes of ``fd`` from ``off`` to ``hasher`` through this thread's small
    buffer (``_chunk``); False where the file ends first."""
    chunk, end = _chunk(), off + n
    while off < end:
        piece = chunk[: min(len(chunk), end - off)]
        got = os.preadv(fd, [piece], off)
        if got == 0:
            return False
        hasher.update(piece[:got])
        off += got
    return True


def _write_parts(
    store: Store, job: RangeJob, fd: int, buf: memoryview, got: int
) -> tuple[int, int]:
    """Check each manifest part of the range in ``buf`` (``got`` bytes of it arrived);
    re-fetch only the bad ones, into their place. Returns the bytes re-fetched and how many
    parts were."""
    ref, start, extra, refetched = job.ref, job.start, 0, 0
    assert ref.parts is not None and ref.part_size is not None
    for i in _parts_of(ref, start, job.length):
        off, n = ref.part_range(i)
        part = buf[off - start : off - start + n]
        have = min(n, max(0, got - (off - start)))  # a short read leaves the tail parts short
        tries = 0
        while have != n or not part_matches(ref, i, part):
            if tries == PART_RETRIES:
                raise IntegrityError(
                    f"{ref.path} ({job.key})",
                    f"{ref.part_hash} mismatch in part {i} (bytes {off}-{off + n - 1}) after "
                    f"{PART_RETRIES} re-fetches",
                    "the stored blob is corrupt; republish the release",
                )
            tries += 1
            refetched += 1
            have = _read(store, job.key, off, part)
            extra += have
        _pwrite(job.tmp, fd, part, off)
    return extra, refetched


def file_mismatch(ref: FileRef, key: str, digest: str) -> IntegrityError:
    return IntegrityError(
        f"{ref.path} ({key})",
        f"sha256 mismatch: got {digest[:12]}…, manifest says {ref.sha256[:12]}… "
        f"after {FILE_RETRIES} whole-file re-fetches",
        "the stored blob is corrupt; republish the release",
    )


def _short(ref: FileRef, key: str, start: int, length: int, got: int) -> IntegrityError:
    return IntegrityError(
        f"{ref.path} ({key})",
        f"short read at offset {start}: {got} of {length} bytes",
        "the stored blob is truncated; republish the release",
    )


def _read(store: Store, key: str, start: int, buf: memoryview) -> int:
    """Fill ``buf`` from ``key`` at ``start`` (retried); the bytes that came."""
    return with_retries(lambda: store.read_range_into(key, start, buf))


@contextmanager
def local_write(path: Path) -> Iterator[None]:
    """A failed local write (no space left, read-only volume) is one line and exit 1, about
    the model's directory: the file being written is a temporary one of ours."""
    try:
        yield
    except OSError as e:
        raise PipelineError(
            str(user_visible(path)),
            f"cannot write: {e.strerror or e}",
            "check free space and permissions",
        ) from None


def _pwrite(path: str, fd: int, data: memoryview, offset: int) -> None:
    with local_write(Path(path)):
        while data:  # pwrite may write less than asked (at most ~2 GiB a call on Linux)
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n


def preallocated(path: Path, size: int) -> int:
    """A new temporary file of ``size`` bytes, opened for ``pwrite``. Blocks are reserved
    where the filesystem can (no fragmentation, ENOSPC now rather than mid-pull)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        if not reserve(fd, 0, size):
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reserve(fd: int, start: int, length: int) -> bool:
    """Reserve the blocks of ``fd``'s bytes ``start`` to ``start + length`` (the file grows
    to cover them); False where the platform or filesystem cannot. Where the filesystem has
    no fallocate of its own, glibc's stand-in writes a byte into every block: only ever
    reserve bytes no other process is writing (a worker reserves its own ranges)."""
    try:
        os.posix_fallocate(fd, start, length)
        return True
    except AttributeError:  # not on this platform
        return False
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            raise
        return False


def sha256_fd(fd: int, size: int) -> str:
    """The sha256 of the file's first ``size`` bytes (of fewer, where it is shorter)."""
    h = hashlib.sha256()
    _hash_on_disk(h, fd, 0, size)
    return h.hexdigest()


def with_retries(fn: Callable[[], T], attempts: int = RETRIES, base: float = 0.2) -> T:
    """Retry throttling, 5xx and dropped connections (StoreError, OSError) with jittered
    exponential backoff; bad input and missing objects fail at once."""
    for attempt in range(attempts):
        try:
            return fn()
        except (StoreError, OSError, ConnectionError):
            if attempt == attempts - 1:
                raise
            time.sleep(base * (2**attempt) * (0.5 + random.random()))
        except PipelineError:
            raise
    raise AssertionError("unreachable")
