"""``pull``: install a release from the store for the EKS init-container.

manifest → ranged GETs of several files at once → each part checked as it lands → atomic
install. See docs/pull.md for the flags, the defaults and why.

* A pool of ``concurrency`` threads takes ranges from one queue, a range of each file in
  turn, so small files and the ranges of large ones are all in flight together. A thread
  fetches a range, checks each manifest part in it against its sha256 (hashlib releases the
  GIL, so checks run on every core), and writes it at its offset with ``os.pwrite`` into a
  preallocated temporary file. Bytes in memory stay below concurrency × range size.
* One process: its threads hold the GIL about 0.04-0.05 s per GB landed (the bytes go
  from the socket into the buffer, through sha256 and into the file without it), so one
  process is not GIL-bound below ~20 GB/s. Worker processes were measured on 16 cores
  and gave nothing but memory (docs/pull.md).
* A bad part (wrong bytes, short read) is fetched again, alone, up to ``PART_RETRIES`` times.
  The whole-file sha256 (the blob's name) is checked where it costs nothing extra (a file of
  one range, hashed in memory), and for every file with ``verify="full"``. Files whose ref has
  no part digests (manifest schema 1) are checked whole after they land, and fetched again,
  whole, up to ``FILE_RETRIES`` times on a mismatch.
* Files land in ``DEST/<model>/.staging-<version>/`` (a stable name, so a restarted init
  container resumes: files already there and verified are kept, and so are the parts of a
  half-fetched file that match their digests); the staging directory is
  renamed to ``DEST/<model>/<version>`` only when every file is verified, then ``current`` is
  swapped atomically. A failure leaves the previous install and ``current`` untouched.

This module imports no torch: it must start fast in a slim image.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import itertools
import math
import os
import queue
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, TypeVar

from pipeline._files import FILE_MODE, atomic_write_bytes, sha256_file, user_visible
from pipeline._progress import ByteProgress, byte_progress
from pipeline.contracts.store_layout import blob_key
from pipeline.errors import IntegrityError, PipelineError, StoreError
from pipeline.install.installed import (
    CURRENT,
    MANIFEST,
    SIGNATURE,
    TEMPORARY_SUFFIX,
    release_files,
)
from pipeline.store.base import Store
from pipeline.store.refs import PART_SIZE, FileRef
from pipeline.store.signing import Trust
from pipeline.store.verified import read_verified

DEFAULT_PART = PART_SIZE  # bytes per ranged GET; rounded to whole manifest parts
RETRIES = 6  # transport errors (throttling, 5xx, resets) per request
PART_RETRIES = 3  # re-fetches of one part whose bytes do not match its digest
FILE_RETRIES = 2  # whole-file re-fetches of a file checked only whole
# Concurrency: 4 threads per available CPU, at least 8 and at most 32. Threads mostly wait
# on the network; the CPU work (TLS, botocore, sha256) releases the GIL for large buffers.
# 8 keep a 2-CPU init container's network busy; 32 x 16 MiB = 512 MiB in flight is what an
# init container's memory limit should hold, and already saturates more than 2 CPUs.
MIN_CONCURRENCY, MAX_CONCURRENCY, THREADS_PER_CPU = 8, 32, 4
# Files whose ranges the queue takes in turn. Each is open (a file descriptor) from its first
# range to its last, so this bounds the open files far below a container's usual 1,024.
FILES_IN_TURN = 64
Verify = Literal["parts", "full"]
T = TypeVar("T")


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU limit (a
    container on a 192-vCPU node with a 2-CPU limit gets 2, not 192)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def default_concurrency(cpus: int | None = None) -> int:
    cpus = available_cpus() if cpus is None else cpus
    return max(MIN_CONCURRENCY, min(MAX_CONCURRENCY, THREADS_PER_CPU * cpus))


@dataclass(frozen=True)
class PullResult:
    model: str
    version: str
    path: Path
    files: int
    downloaded_bytes: int
    reused_bytes: int
    seconds: float
    already_installed: bool
    parts: int = 0  # ranged GETs that landed (re-fetches not counted)
    refetched_parts: int = 0
    refetched_files: int = 0
    concurrency: int = 0
    part_size: int = 0
    verify: str = "parts"
    signed_by: str | None = None  # the signing key's id, as stored
    signature: str = "not checked"  # "verified" against a trusted key, or "not checked"

    @property
    def throughput(self) -> float:
        """Downloaded bytes per second of the whole pull."""
        return self.downloaded_bytes / max(self.seconds, 1e-9)

    def to_dict(self) -> dict:
        return {**self.__dict__, "path": str(self.path), "throughput": round(self.throughput)}


def pull_release(
    store: Store,
    model: str,
    dest: Path,
    *,
    version: str | None = None,
    channel: str | None = None,
    concurrency: int | None = None,
    part_size: int = DEFAULT_PART,
    verify: Verify = "parts",
    trust: Trust | None = None,
) -> PullResult:
    """Install a release; see the module docstring. ``trust``: install only a release
    whose manifest a trusted key signed (``pipeline.store.verified``); nothing is written
    before that is checked."""
    start = time.monotonic()
    concurrency = concurrency or default_concurrency()
    release = read_verified(store, model, version=version, channel=channel, trust=trust)
    manifest, raw, version = release.manifest, release.data, release.manifest.version
    sig = release.signature.model_dump_json(indent=2).encode() if release.signature else None
    files = release_files(manifest)  # refuses paths that leave the release directory
    model_dir = Path(dest) / model
    final = model_dir / version
    total = sum(ref.size for _, ref in files)
    result = PullResult(
        model, version, final, len(files), 0, total, 0.0, True,
        concurrency=concurrency, part_size=part_size, verify=verify,
        signed_by=release.signature.key_id if release.signature else None,
        signature="verified" if release.trusted else "not checked",
    )  # fmt: skip
    if (final / MANIFEST).is_file() and (final / MANIFEST).read_bytes() == raw:
        _install_signature(final, sig)  # signed since it was installed, or re-signed
        _point_current(model_dir, version)
        return replace(result, seconds=time.monotonic() - start)

    staging = model_dir / f".staging-{version}"
    staging.mkdir(parents=True, exist_ok=True)
    _install_signature(staging, sig)
    return _pull_into(store, staging, final, model_dir, files, raw, result, start, part_size)


def _install_signature(release_dir: Path, sig: bytes | None) -> None:
    """``signature.json`` beside the manifest (what ``open_installed(trust=...)`` checks)."""
    path = release_dir / SIGNATURE
    if sig is None:
        path.unlink(missing_ok=True)
    elif not path.is_file() or path.read_bytes() != sig:
        atomic_write_bytes(path, sig)


def _pull_into(
    store: Store,
    staging: Path,
    final: Path,
    model_dir: Path,
    files: list[tuple[str, FileRef]],
    raw: bytes,
    result: PullResult,
    start: float,
    part_size: int,
) -> PullResult:
    model, version, concurrency, verify = (
        result.model, result.version, result.concurrency, result.verify,
    )  # fmt: skip
    total = result.reused_bytes
    # Resume: files a killed pull finished are kept if they still verify (checked in parallel).
    with ThreadPoolExecutor(concurrency) as checks:
        kept = list(checks.map(lambda f: _verified(staging / f[0], f[1]), files))
    # The same bytes under several paths (each bucket's weights.safetensors) download once.
    have: dict[str, Path] = {}
    fetching: set[str] = set()
    fetch, copies = [], []
    for (rel, ref), ok in zip(files, kept, strict=True):
        target = staging / rel
        if ok:
            have.setdefault(ref.sha256, target)
        elif ref.sha256 in have or ref.sha256 in fetching:
            copies.append((target, ref))
        else:
            fetch.append((target, ref))
            fetching.add(ref.sha256)
    reused = total - sum(ref.size for _, ref in fetch)
    fetcher = _Fetcher(store, concurrency, part_size, verify)
    with byte_progress(f"pull {model} {version}", total) as progress:
        progress.advance(reused)
        fetcher.fetch_all(fetch, progress)
    have.update({ref.sha256: target for target, ref in fetch})
    for target, ref in copies:
        _link_or_copy(have[ref.sha256], target)
    (staging / MANIFEST).write_bytes(raw)
    _replace_dir(staging, final)
    _point_current(model_dir, version)
    return replace(
        result,
        downloaded_bytes=fetcher.downloaded,
        reused_bytes=reused + fetcher.resumed,
        seconds=time.monotonic() - start,
        already_installed=False,
        parts=fetcher.parts,
        refetched_parts=fetcher.refetched_parts,
        refetched_files=fetcher.refetched_files,
    )


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _verified(path: Path, ref: FileRef) -> bool:
    try:
        return path.stat().st_size == ref.size and sha256_file(path) == ref.sha256
    except FileNotFoundError:
        return False


def _link_or_copy(src: Path, dest: Path) -> None:
    """A hard link where the filesystem allows (no extra disk), else a copy; atomic."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}{TEMPORARY_SUFFIX}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def _replace_dir(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``. An earlier, different install under that name is
    renamed aside first and deleted only after: ``final`` is missing for the moment between
    two renames, not for as long as deleting a release takes (nor for good, if the pull is
    killed meanwhile: the next pull of the version deletes what was set aside)."""
    aside = final.with_name(f".replaced-{final.name}")
    if aside.exists():
        shutil.rmtree(aside)
    if final.exists():
        os.rename(final, aside)
    os.rename(staging, final)
    shutil.rmtree(aside, ignore_errors=True)


def _point_current(model_dir: Path, version: str) -> None:
    """Swap ``current`` to ``version`` atomically (a new symlink renamed over the old)."""
    tmp = model_dir / f".{CURRENT}.{os.getpid()}.{random.randrange(1 << 30)}"
    os.symlink(version, tmp)
    os.replace(tmp, model_dir / CURRENT)


@dataclass(eq=False)
class _File:
    """One file being fetched: its temporary file and how many of its ranges are still out."""

    target: Path
    ref: FileRef
    ranges: list[tuple[int, int]]
    fd: int | None = None
    left: int = 0
    attempts: int = 0  # whole-file re-fetches so far
    # A killed pull's full-size temporary file: ranges whose parts already verify are kept.
    resume: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tmp(self) -> Path:
        return self.target.with_name(f".{self.target.name}{TEMPORARY_SUFFIX}")

    @property
    def key(self) -> str:
        return blob_key(self.ref.sha256)

    def checked_whole(self, verify: Verify) -> bool:
        """Whether the whole-file digest is read back and checked once every range landed.
        Not needed where it was already checked for free: a file of one range without part
        digests (hashed in memory), or of one part (its part digest is the whole digest)."""
        if self.ref.parts is None:
            return len(self.ranges) > 1
        return verify == "full" and len(self.ref.parts) > 1


class _Fetcher:
    """A pool of threads taking ranges from one queue; see the module docstring."""

    def __init__(
        self,
        store: Store,
        concurrency: int,
        part_size: int,
        verify: Verify,
    ) -> None:
        self.store = store
        self.concurrency = max(1, concurrency)
        self.part_size = max(1 << 16, part_size)
        self.verify = verify
        self.downloaded = self.parts = self.refetched_parts = self.refetched_files = 0
        self.resumed = 0  # bytes of partial files a killed pull left, kept because they verify
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[tuple[_File, int, int] | None] = queue.SimpleQueue()
        self._open_files = 0
        self._error: BaseException | None = None

    def range_size(self, ref: FileRef) -> int:
        """``part_size`` rounded to a whole number (≥ 1) of the manifest's parts."""
        if ref.part_size is None:
            return self.part_size
        return max(1, round(self.part_size / ref.part_size)) * ref.part_size

    def fetch_all(self, jobs: list[tuple[Path, FileRef]], progress: ByteProgress) -> None:
        self.progress = progress
        files = []
        for target, ref in jobs:
            target.parent.mkdir(parents=True, exist_ok=True)
            step = self.range_size(ref)
            f = _File(target, ref, [(o, min(step, ref.size - o)) for o in range(0, ref.size, step)])
            f.resume = ref.parts is not None and _size(f.tmp) == ref.size
            if not f.ranges:
                self._empty(f)
            else:
                files.append(f)
        self._open_files = len(files)
        for f in files:
            f.left = len(f.ranges)
        for f, (start, length) in _interleaved(files):
            self._queue.put((f, start, length))
        threads: list[threading.Thread] = []
        try:
            for i in range(min(self.concurrency, sum(len(f.ranges) for f in files))):
                threads.append(threading.Thread(target=self._worker, name=f"pull-{i}", daemon=True))
                _start(threads[-1])
            with self._idle:
                while self._open_files and self._error is None:
                    self._idle.wait(0.5)
        finally:
            with self._lock:
                self._error = self._error or (_Stopped() if self._open_files else None)
            for _ in threads:
                self._queue.put(None)
            for t in threads:
                if t.ident is not None:  # started
                    t.join()
            for f in files:
                if f.fd is not None:  # unfinished
                    os.close(f.fd)
                    if f.ref.parts is None:  # unverified bytes: discard them
                        f.tmp.unlink(missing_ok=True)
                    # else only verified parts were written: the next pull resumes from them
        if self._error is not None and not isinstance(self._error, _Stopped):
            raise self._error
        assert not self._open_files, "the fetch stopped with files still open"

    def _enqueue(self, f: _File) -> None:
        f.left = len(f.ranges)
        for start, length in f.ranges:
            self._queue.put((f, start, length))

    def _worker(self) -> None:
        while (task := self._queue.get()) is not None:
            if self._error is not None:
                continue  # failing: drain the queue without fetching
            try:
                self._land(*task)
            except BaseException as e:  # handed to the main thread, which raises it
                with self._idle:
                    self._error = self._error or e
                    self._idle.notify_all()

    def _land(self, f: _File, start: int, length: int) -> None:
        """Land one range; finish the file if it was last."""
        whole = f.ref.parts is None and len(f.ranges) == 1
        job = RangeJob(f.key, f.ref, str(f.tmp), start, length, whole, f.resume)
        out = land_range(self.store, job, lambda: self._opened(f))
        with self._lock:
            if out.resumed:
                self.resumed += length
            else:
                self.downloaded += out.got
                self.parts += 1
            self.refetched_parts += out.refetched_parts
            self.refetched_files += out.refetched_files
        self._landed(f, length)

    def _opened(self, f: _File) -> int:
        """The file's temporary, opened by the first range to need it. Asked for once that
        range's bytes are in: preallocating a large file can take a while (tmpfs zeroes its
        pages), and its other ranges should be on the wire meanwhile, not waiting here."""
        with f.lock, _local_write(f.tmp):
            if f.fd is None:
                f.fd = os.open(f.tmp, os.O_RDWR) if f.resume else _preallocated(f.tmp, f.ref.size)
            return f.fd

    def _landed(self, f: _File, length: int) -> None:
        self.progress.advance(length)
        with f.lock:
            f.left -= 1
            last = f.left == 0
        if last:
            self._finish(f)

    def _finish(self, f: _File) -> None:
        assert f.fd is not None
        if f.checked_whole(self.verify):
            digest = _sha256_fd(f.fd, f.ref.size)
            if digest != f.ref.sha256:
                self._count_file_refetch(f, digest)
                f.resume = False
                self._enqueue(f)  # the ranges overwrite every byte of the temporary file
                return
        os.close(f.fd)
        f.fd = None
        os.replace(f.tmp, f.target)
        with self._idle:
            self._open_files -= 1
            self._idle.notify_all()

    def _count_file_refetch(self, f: _File, digest: str) -> None:
        if f.attempts == FILE_RETRIES:
            raise _file_mismatch(f.ref, f.key, digest)
        f.attempts += 1
        with self._lock:
            self.refetched_files += 1

    def _empty(self, f: _File) -> None:
        if hashlib.sha256(b"").hexdigest() != f.ref.sha256:
            raise IntegrityError(f.ref.path, "sha256 mismatch: size 0", "republish the release")
        f.tmp.write_bytes(b"")
        os.replace(f.tmp, f.target)


class _Stopped(Exception):
    """The fetch was stopped from the calling thread (an exception there, Ctrl-C): the
    workers drain the queue, and the caller's own exception is what propagates. A class of
    its own, so no error a worker raises (an OSError with EINTR is an InterruptedError) can
    pass for it."""


def _start(thread: threading.Thread) -> None:
    try:
        thread.start()
    except RuntimeError as e:  # can't start new thread: the container's pids or memory limit
        raise PipelineError(
            "pull", f"cannot start thread {thread.name}: {e}", "lower --concurrency"
        ) from None


def _interleaved(
    files: list[_File], window: int = FILES_IN_TURN
) -> Iterator[tuple[_File, tuple[int, int]]]:
    """Every file's ranges, one range of each of ``window`` files in turn (the next file
    taking the place of one whose ranges are done): the threads spread over the large files
    instead of all writing into one. Writes into one file serialise on its inode lock
    (``pwrite`` was 39% of the threads' time with all 32 on one file, on 16 cores, 4 files
    of 1 GiB: docs/pull.md)."""
    waiting = iter(files)
    turn = collections.deque((f, iter(f.ranges)) for f in itertools.islice(waiting, window))
    while turn:
        f, ranges = turn.popleft()
        r = next(ranges, None)
        if r is not None:
            yield f, r
            turn.append((f, ranges))
        elif (g := next(waiting, None)) is not None:
            turn.append((g, iter(g.ranges)))


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
    unless resuming): the range is read into this thread's buffer, each manifest part is
    checked against its sha256 there and written from there, and a bad one is fetched
    again, alone, into its place in the buffer (up to ``PART_RETRIES`` times)."""
    ref, key, start, length = job.ref, job.key, job.start, job.length
    buf = _buffer(length)
    if job.resume and _already_there(open_fd(), ref, start, buf):
        return Landed(resumed=True)
    got = _read(store, key, start, buf)
    fd = open_fd()
    fetched, refetched_parts, refetched_files = got, 0, 0
    if ref.parts is not None:
        extra, refetched_parts = _write_parts(store, job, fd, buf, got)
        fetched += extra
    elif job.whole:  # the whole file in memory: check it now, for free
        while got != length or (digest := hashlib.sha256(buf).hexdigest()) != ref.sha256:
            if refetched_files == FILE_RETRIES:
                raise _file_mismatch(ref, key, digest if got == length else "short")
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


_THREAD = threading.local()


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


def _already_there(fd: int, ref: FileRef, start: int, buf: memoryview) -> bool:
    """Whether every part of the range is already on disk with the right digest (read
    into ``buf``, the range's buffer)."""
    assert ref.parts is not None and ref.part_size is not None
    for i in _parts_of(ref, start, len(buf)):
        off, n = ref.part_range(i)
        part = buf[off - start : off - start + n]
        if os.preadv(fd, [part], off) != n or hashlib.sha256(part).hexdigest() != ref.parts[i]:
            return False
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
        while have != n or hashlib.sha256(part).hexdigest() != ref.parts[i]:
            if tries == PART_RETRIES:
                raise IntegrityError(
                    f"{ref.path} ({job.key})",
                    f"sha256 mismatch in part {i} (bytes {off}-{off + n - 1}) after "
                    f"{PART_RETRIES} re-fetches",
                    "the stored blob is corrupt; republish the release",
                )
            tries += 1
            refetched += 1
            have = _read(store, job.key, off, part)
            extra += have
        _pwrite(job.tmp, fd, part, off)
    return extra, refetched


def _file_mismatch(ref: FileRef, key: str, digest: str) -> IntegrityError:
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
def _local_write(path: Path) -> Iterator[None]:
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
    with _local_write(Path(path)):
        while data:  # pwrite may write less than asked (at most ~2 GiB a call on Linux)
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n


def _preallocated(path: Path, size: int) -> int:
    """A new temporary file of ``size`` bytes, opened for ``pwrite``. Blocks are reserved
    where the filesystem can (no fragmentation, ENOSPC now rather than mid-pull)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except AttributeError:  # not on this platform
            os.ftruncate(fd, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sha256_fd(fd: int, size: int) -> str:
    h, off = hashlib.sha256(), 0
    while off < size:
        chunk = os.pread(fd, min(1 << 20, size - off), off)
        if not chunk:
            break
        h.update(chunk)
        off += len(chunk)
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


__all__ = [
    "Landed",
    "PullResult",
    "RangeJob",
    "available_cpus",
    "default_concurrency",
    "land_range",
    "pull_release",
    "with_retries",
]
