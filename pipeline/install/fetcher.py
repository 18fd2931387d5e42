"""The pull's threads: ``concurrency`` of them take ranges from one queue, a range of each of
``FILES_IN_TURN`` files in turn, and land each (``pipeline.install.landing``); a file is
checked whole where it has no part digests, and a stop from the caller drains them."""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from pipeline._progress import ByteProgress
from pipeline.contracts.store_layout import blob_key
from pipeline.errors import IntegrityError, PipelineError
from pipeline.install.installed import temporary
from pipeline.install.landing import (
    FILE_RETRIES,
    RangeJob,
    file_mismatch,
    land_range,
    local_write,
    preallocated,
    reserve,
    sha256_fd,
)
from pipeline.store.base import Store
from pipeline.store.refs import FileRef

# Files whose ranges the queue takes in turn. Each is open (a file descriptor) from its first
# range to its last, so this bounds the open files far below a container's usual 1,024.
FILES_IN_TURN = 64


Verify = Literal["parts", "full"]


Range = tuple[Path, int, int]  # a file's target, and the offset and length of one range


@dataclass(frozen=True)
class Shared:
    """Files other processes land too (``pipeline.install.processes``): this process lands
    the ranges it claims, one batch at a time, first come first served, so a process that
    runs slower (a slow connection, a busy core) takes fewer; it neither checks these files
    whole nor installs them."""

    files: dict[Path, tuple[FileRef, bool]]  # target -> (ref, resume: decided by the caller)
    claim: Callable[[], list[Range]]  # the next ranges not yet claimed; [] once none are left


def resumable(tmp: Path, ref: FileRef) -> bool:
    """Whether a killed pull's temporary file is kept, its parts checked one by one: it
    has the file's full size and the file has part digests."""
    try:
        return ref.parts is not None and tmp.stat().st_size == ref.size
    except FileNotFoundError:
        return False


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
    shared: bool = False  # other processes land its other ranges (``Shared``)
    inflight: int = 0  # of a shared file: this process's ranges of it being landed now
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tmp(self) -> Path:
        return temporary(self.target)

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


class Fetcher:
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
        self._shared: dict[Path, _File] = {}
        self._claim: Callable[[], list[Range]] | None = None
        self._claiming = 0  # threads that may still claim shared ranges

    def ranges(self, ref: FileRef) -> list[tuple[int, int]]:
        """The file's ranges, (offset, length) each."""
        step = self.range_size(ref)
        return [(o, min(step, ref.size - o)) for o in range(0, ref.size, step)]

    def range_size(self, ref: FileRef) -> int:
        """``part_size`` rounded to a whole number (≥ 1) of the manifest's parts."""
        if ref.part_size is None:
            return self.part_size
        return max(1, round(self.part_size / ref.part_size)) * ref.part_size

    def fetch_all(
        self,
        jobs: list[tuple[Path, FileRef]],
        progress: ByteProgress,
        shared: Shared | None = None,
    ) -> None:
        """Land and install every file of ``jobs``; and of ``shared``'s files, the ranges
        this process claims, into their temporary files, left for the caller."""
        self.progress = progress
        files = []
        for target, ref in jobs:
            target.parent.mkdir(parents=True, exist_ok=True)
            f = _File(target, ref, self.ranges(ref))
            f.resume = resumable(f.tmp, ref)
            if not f.ranges:
                self._empty(f)
            else:
                files.append(f)
        self._open_files = len(files)
        for f in files:
            f.left = len(f.ranges)
        for f, (start, length) in interleaved(files):
            self._queue.put((f, start, length))
        n = sum(len(f.ranges) for f in files)
        if shared is not None:
            self._shared = {t: _File(t, ref, [], resume=res, shared=True)
                            for t, (ref, res) in shared.files.items()}  # fmt: skip
            self._claim, n = shared.claim, self.concurrency
        threads: list[threading.Thread] = []
        try:
            for i in range(min(self.concurrency, n)):
                threads.append(threading.Thread(target=self._worker, name=f"pull-{i}", daemon=True))
                with self._lock:
                    self._claiming += self._claim is not None
                _start(threads[-1])
            with self._idle:
                while (self._open_files or self._claiming) and self._error is None:
                    self._idle.wait(0.5)
        finally:
            with self._lock:
                busy = self._open_files or self._claiming
                self._error = self._error or (_Stopped() if busy else None)
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
                    # else the next pull resumes, keeping only the parts that verify
        if self._error is not None and not isinstance(self._error, _Stopped):
            raise self._error
        assert not self._open_files, "the fetch stopped with files still open"

    def _enqueue(self, f: _File) -> None:
        f.left = len(f.ranges)
        for start, length in f.ranges:
            self._queue.put((f, start, length))

    def _worker(self) -> None:
        try:
            if self._claim is not None:
                self._claim_ranges()
            while (task := self._queue.get()) is not None:
                if self._error is None:  # else failing: drain the queue without fetching
                    self._land(*task)
        except BaseException as e:  # handed to the main thread, which raises it
            with self._idle:
                self._error = self._error or e
                self._idle.notify_all()

    def _claim_ranges(self) -> None:
        """Land shared ranges as they are claimed, this process's own first, until none are
        left (or a failure); then this thread only takes this process's own."""
        assert self._claim is not None
        try:
            while self._error is None:
                try:
                    task = self._queue.get_nowait()
                except queue.Empty:
                    pass
                else:
                    if task is None:  # stopped
                        self._queue.put(None)  # for the loop after this one
                        return
                    if self._error is None:  # another thread may have failed since
                        self._land(*task)
                    continue
                claimed = self._claim()
                if not claimed:
                    return
                for target, start, length in claimed:
                    if self._error is None:
                        self._land_shared(self._shared[target], start, length)
        finally:
            with self._idle:
                self._claiming -= 1
                self._idle.notify_all()

    def _land_shared(self, f: _File, start: int, length: int) -> None:
        """Land a claimed range of a shared file. The file is open only while this process
        lands a range of it: a worker may claim ranges of every file of the release, far
        more than a container's open files allow at once."""
        with f.lock:
            f.inflight += 1
        try:
            self._land(f, start, length)
        finally:
            with f.lock:
                f.inflight -= 1
                if not f.inflight and f.fd is not None:
                    os.close(f.fd)
                    f.fd = None

    def _land(self, f: _File, start: int, length: int) -> None:
        """Land one range; finish the file if it was last."""
        whole = f.ref.parts is None and len(f.ranges) == 1
        job = RangeJob(f.key, f.ref, str(f.tmp), start, length, whole, f.resume)
        out = land_range(self.store, job, lambda: self._opened(f, start, length))
        with self._lock:
            if out.resumed:
                self.resumed += length
            else:
                self.downloaded += out.got
                self.parts += 1
            self.refetched_parts += out.refetched_parts
            self.refetched_files += out.refetched_files
        self._landed(f, length)

    def _opened(self, f: _File, start: int, length: int) -> int:
        """The file's temporary, opened by the first range to need it. Asked for once that
        range's bytes are in (a streamed range's first MiB): preallocating a large file can
        take a while (tmpfs zeroes its pages), and its other ranges should be on the wire
        meanwhile, not waiting here (streamed, they wait after their first MiB). Of a
        shared file (made at full size by the caller) only this range's blocks are reserved:
        by the process that writes them, in parallel with the others."""
        with local_write(f.tmp):
            with f.lock:
                if f.fd is None:
                    if f.resume or f.shared:
                        f.fd = os.open(f.tmp, os.O_RDWR)
                    else:
                        f.fd = preallocated(f.tmp, f.ref.size)
                fd = f.fd
            if f.shared and not f.resume:  # outside the lock: its other ranges need not wait
                reserve(fd, start, length)
            return fd

    def _landed(self, f: _File, length: int) -> None:
        self.progress.advance(length)
        if f.shared:  # the caller installs it once every process is done
            return
        with f.lock:
            f.left -= 1
            last = f.left == 0
        if last:
            self._finish(f)

    def _finish(self, f: _File) -> None:
        assert f.fd is not None
        if f.checked_whole(self.verify):
            digest = sha256_fd(f.fd, f.ref.size)
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
            raise file_mismatch(f.ref, f.key, digest)
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


class _HasRanges(Protocol):
    ranges: list[tuple[int, int]]


F = TypeVar("F", bound=_HasRanges)


def interleaved(files: list[F], window: int = FILES_IN_TURN) -> Iterator[tuple[F, tuple[int, int]]]:
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
