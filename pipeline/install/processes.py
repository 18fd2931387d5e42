"""The pull's files shared out to worker processes, each landing its share with a
``Fetcher`` of its own threads (``pipeline.install.fetcher``): a GIL each.

Why: over TLS a Python socket read returns one 16 KiB record and takes the GIL back for the
next, so one process's threads queue for the GIL about a million times per 16 GiB. On 16
cores against nginx over TLS 1.3 one process landed 1.0-1.25 GB/s whatever its threads, 8
in flight faster than 32, and 4, 8 and 16 forked processes 2.7-2.9, 3.1-3.8 and 4.2 GB/s
(bench/RESULTS.md, 2026-12-07). Over plain HTTP the reads are large and one process was not
GIL-bound (4 processes: 1.2x for 2.2x the memory), so the store decides
(``Store.pull_processes``).

The files are split by bytes, largest first, so a release of a few huge files gets as many
processes as files. Each child is forked before the progress bar's thread starts, sends its
progress and its end (counts, or the exception, pickled) on a pipe of its own, and dies with
the parent (``PR_SET_PDEATHSIG``). The first failure ends the others: what they landed is
verified parts only, which the next pull resumes from (as after a SIGKILL)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import select
import signal
import struct
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pipeline._progress import ByteProgress
from pipeline.errors import PipelineError
from pipeline.install.fetcher import Fetcher, Verify
from pipeline.store.base import Store
from pipeline.store.refs import FileRef

COUNTS = ("downloaded", "parts", "refetched_parts", "refetched_files", "resumed")
_HEAD = struct.Struct("!I")  # a message's length; then its pickle
PR_SET_PDEATHSIG = 1


def split_by_bytes(jobs: list[tuple[Path, FileRef]], n: int) -> list[list[tuple[Path, FileRef]]]:
    """``jobs`` in at most ``n`` groups of about equal bytes (largest file first, each to the
    lightest group); no group is empty."""
    groups: list[list[tuple[Path, FileRef]]] = [[] for _ in range(max(1, n))]
    sizes = [0] * len(groups)
    for job in sorted(jobs, key=lambda j: -j[1].size):
        k = sizes.index(min(sizes))
        groups[k].append(job)
        sizes[k] += job[1].size
    return [g for g in groups if g]


@dataclass
class _Child:
    pid: int
    fd: int  # the read end of its pipe
    data: bytearray = field(default_factory=bytearray)
    end: tuple[str, object] | None = None  # ("done", counts) or ("error", exception)


class WorkerProcesses:
    """``Fetcher``'s interface (``fetch_all`` and its counts) over forked processes; call
    ``start`` before any other thread of the process starts (a progress bar's)."""

    def __init__(
        self, store: Store, processes: int, concurrency: int, part_size: int, verify: Verify
    ) -> None:
        self.store, self.processes = store, max(1, processes)
        self.concurrency, self.part_size, self.verify = concurrency, part_size, verify
        for name in COUNTS:
            setattr(self, name, 0)
        self._children: list[_Child] = []
        self._stopped = False
        self._first_error: BaseException | None = None

    def start(self, jobs: list[tuple[Path, FileRef]]) -> None:
        groups = split_by_bytes(jobs, self.processes)
        threads = max(1, self.concurrency // max(1, len(groups)))
        try:
            for group in groups:
                self._children.append(self._fork(group, threads))
        except BaseException:
            self._stop()
            raise

    def fetch_all(self, jobs: list[tuple[Path, FileRef]], progress: ByteProgress) -> None:
        if not self._children:
            self.start(jobs)
        if self._stopped:
            raise RuntimeError("fetch_all after close")
        try:
            self._wait(progress)
        finally:
            self._stop()
        if self._first_error is not None:  # the failure itself, not the workers it stopped
            raise self._first_error
        if any(c.end is None for c in self._children):
            raise PipelineError(
                "pull",
                "a worker process ended without reporting (killed: out of memory?)",
                "check the init container's memory limit, or pull with --processes 1",
            )
        for child in self._children:
            assert child.end is not None
            for name, n in zip(COUNTS, child.end[1], strict=True):  # type: ignore[call-overload]
                setattr(self, name, getattr(self, name) + n)

    def _fork(self, group: list[tuple[Path, FileRef]], threads: int) -> _Child:
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        try:
            r, w = os.pipe()
        except OSError as e:
            raise _cannot_start(e) from None
        try:
            pid = os.fork()
        except OSError as e:  # the container's pids limit, or memory
            os.close(r)
            os.close(w)
            raise _cannot_start(e) from None
        if pid == 0:  # the child: never returns
            os.close(r)
            _child_main(self, group, threads, w, parent)
        os.close(w)
        return _Child(pid, r)

    def _wait(self, progress: ByteProgress) -> None:
        """Read every child's messages until each has closed its pipe; the first failure
        ends the others."""
        open_fds = {c.fd: c for c in self._children}
        while open_fds:
            ready, _, _ = select.select(list(open_fds), [], [])
            for fd in ready:
                child = open_fds[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del open_fds[fd]
                    if child.end is None or child.end[0] != "done":
                        return  # failed, or died without a word: stop the others
                    continue
                child.data += chunk
                for kind, value in _messages(child.data):
                    if kind == "advance":
                        progress.advance(value)  # type: ignore[arg-type]
                    else:
                        child.end = (kind, value)
                        if kind == "error" and self._first_error is None:
                            self._first_error = value  # type: ignore[assignment]

    def close(self) -> None:
        """Kill what still runs and reap every child (none outlives the pull); once."""
        self._stop()

    def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for child in self._children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
        for child in self._children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, 0)
            with contextlib.suppress(OSError):
                os.close(child.fd)


def _cannot_start(e: OSError) -> PipelineError:
    return PipelineError(
        "pull",
        f"cannot start a worker process: {e.strerror or e}",
        "pull with --processes 1, or raise the container's pids or memory limit",
    )


def _messages(data: bytearray) -> list[tuple[str, object]]:
    """The whole messages at the front of ``data``, taken out of it."""
    out = []
    while len(data) >= _HEAD.size:
        (n,) = _HEAD.unpack_from(data)
        if len(data) < _HEAD.size + n:
            break
        out.append(pickle.loads(bytes(data[_HEAD.size : _HEAD.size + n])))
        del data[: _HEAD.size + n]
    return out


class _PipeProgress(ByteProgress):
    """A child's progress, sent to the parent (a range's bytes a message)."""

    def __init__(self, fd: int) -> None:
        super().__init__(None, None)
        self.fd, self.lock = fd, threading.Lock()

    def advance(self, n: int) -> None:
        self.send("advance", n)

    def send(self, kind: str, value: object) -> None:
        body = pickle.dumps((kind, value))
        msg = memoryview(_HEAD.pack(len(body)) + body)
        with self.lock:
            while msg:
                msg = msg[os.write(self.fd, msg) :]


def _child_main(
    procs: WorkerProcesses, group: list[tuple[Path, FileRef]], threads: int, w: int, parent: int
) -> None:
    code = 1
    try:
        # dies with the parent, however the parent ends (not Linux: the parent still kills
        # us on a failure)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent ended before the line above
            os._exit(1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        out = _PipeProgress(w)
        try:
            procs.store.after_fork()
            fetcher = Fetcher(procs.store, threads, procs.part_size, procs.verify)
            fetcher.fetch_all(group, out)
            end: tuple[str, object] = ("done", [getattr(fetcher, n) for n in COUNTS])
            code = 0
        except BaseException as e:  # every failure goes to the parent
            end = ("error", _picklable(e))
        out.send(*end)
    finally:
        os._exit(code)  # no atexit, no finally of the parent's stack, no buffers flushed twice


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # it does not pickle: its line
        return PipelineError("pull", f"{type(e).__name__}: {e}", None)


__all__ = ["WorkerProcesses", "split_by_bytes"]
