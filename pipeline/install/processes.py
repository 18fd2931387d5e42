"""The pull's ranges shared out to worker processes, each landing its share with a
``Fetcher`` of its own threads (``pipeline.install.fetcher``): a GIL each.

Why: over TLS a Python socket read returns one 16 KiB record and takes the GIL back for the
next, so one process's threads queue for the GIL about a million times per 16 GiB. On 16
cores against nginx over TLS 1.3 one process landed 1.0-1.25 GB/s whatever its threads, 8
in flight faster than 32, and 4, 8 and 16 forked processes 2.7-2.9, 3.1-3.8 and 4.2 GB/s
(bench/RESULTS.md, 2026-12-07). Over plain HTTP the reads are large and one process was not
GIL-bound (4 processes: 1.2x for 2.2x the memory), so the store decides
(``Store.pull_processes``).

The ranges of every file checked part by part are claimed by the processes' threads as
they go, one range of each file in turn, first come first served (tickets in a pipe that
every process reads): one huge file (a cuda release's weights) is landed by every process,
and a process slowed by its connections or a busy core takes fewer ranges instead of ending
last with its share. Each lands its ranges into the file's temporary file, and the pull
installs the file once all have. A file checked whole (no part digests, ``--verify full``)
or of one range goes whole to one process, dealt by bytes before the fork, which checks and
installs it as one process's pull does. Each child is
forked before the progress bar's thread starts, sends its progress and its end (counts, or
the exception, pickled) on a pipe of its own, and dies with the parent
(``PR_SET_PDEATHSIG``). The first failure ends the others: the next pull resumes from what
they landed, keeping only the parts that verify (as after a SIGKILL)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import select
import signal
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline._files import FILE_MODE
from pipeline._progress import ByteProgress
from pipeline.errors import PipelineError
from pipeline.install.fetcher import Fetcher, Range, Shared, Verify, interleaved, resumable
from pipeline.install.installed import temporary
from pipeline.install.landing import local_write
from pipeline.store.base import Store
from pipeline.store.refs import FileRef

COUNTS = ("downloaded", "parts", "refetched_parts", "refetched_files", "resumed")
_HEAD = struct.Struct("!I")  # a message's length; then its pickle
_TICKET = struct.Struct("I")  # a batch of shared ranges: its index
PR_SET_PDEATHSIG = 1
PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")


Job = tuple[Path, FileRef]


@dataclass
class Plan:
    """What one worker process lands whole: its jobs, and their bytes."""

    jobs: list[Job] = field(default_factory=list)
    bytes: int = 0


@dataclass
class Work:
    """The pull's files shared out: whole files to one process each (``plans``), and the
    files landed by range (``shared``: target -> (ref, resume)), their ``ranges`` one of
    each file in turn, claimed by whichever process's thread is free."""

    plans: list[Plan]
    shared: dict[Path, tuple[FileRef, bool]]
    ranges: list[Range]


def plan(jobs: list[Job], n: int, fetcher: Fetcher) -> Work:
    """``jobs`` shared out to at most ``n`` processes. A file checked part by part with more
    than one range is shared by range (the caller installs it once every process is done);
    any other file goes whole to the process with the fewest bytes, largest first. A shared
    file is made here at full size, sparse, before any process opens it."""
    whole, split = [], []
    for target, ref in jobs:
        ranges = fetcher.ranges(ref)
        if len(ranges) > 1 and ref.parts is not None and fetcher.verify == "parts":
            split.append((target, ref, ranges))
        else:
            whole.append((target, ref))
    ranges = [(t, *r) for t, r in _turns(split)]
    # every process claims shared ranges; without them only as many as there are files
    plans = [Plan() for _ in range(max(1, min(n, len(whole) + len(ranges))))]
    for target, ref in sorted(whole, key=lambda j: -j[1].size):
        least = min(plans, key=lambda p: p.bytes)
        least.jobs.append((target, ref))
        least.bytes += ref.size
    shared = {}
    for target, ref, _ in split:
        tmp = temporary(target)
        resume = resumable(tmp, ref)  # decided once, before any process opens it
        if not resume:  # made here, once, at full size and sparse: each process opens it as
            # it is and reserves the blocks of the ranges it lands (``landing.reserve``), in
            # parallel and as its bytes come (tmpfs zeroes what it reserves: ~0.3 s a GiB)
            target.parent.mkdir(parents=True, exist_ok=True)
            with local_write(tmp):
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, FILE_MODE)
                try:
                    os.ftruncate(fd, ref.size)
                finally:
                    os.close(fd)
        shared[target] = (ref, resume)
    if not ranges:
        plans = [p for p in plans if p.jobs]
    return Work(plans, shared, ranges)


class Tickets:
    """The shared ranges, claimed a batch at a time by any thread of any process: batch
    numbers written into a pipe before the fork, its write end closed, read 4 bytes at a
    time (a pipe read takes its bytes whole, under the pipe's lock, so no two readers get
    the same ticket; a read at the end gets nothing). Batches of one range, unless the
    pipe cannot hold a ticket for each (it grows to ``/proc/sys/fs/pipe-max-size``, 1 MiB
    by default: 262,144 tickets, 4 TiB of 16 MiB ranges)."""

    def __init__(self, ranges: list[Range]) -> None:
        self.ranges = ranges
        self.fd, w = os.pipe()
        try:
            room = _pipe_room(w, max(1, len(ranges)) * _TICKET.size)
            fits = max(1, room // _TICKET.size)  # tickets the pipe holds: written in one go
            self.batch = max(1, -(-len(ranges) // fits))
            n = -(-len(ranges) // self.batch)  # ≤ fits
            data = memoryview(b"".join(_TICKET.pack(i) for i in range(n)))
            while data:
                data = data[os.write(w, data) :]
        except BaseException:
            os.close(self.fd)
            raise
        finally:
            os.close(w)

    def claim(self) -> list[Range]:
        """The next batch of ranges; [] once every one is claimed."""
        got = os.read(self.fd, _TICKET.size)
        if not got:
            return []
        (i,) = _TICKET.unpack(got)
        return self.ranges[i * self.batch : (i + 1) * self.batch]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _pipe_room(fd: int, want: int) -> int:
    """Bytes the pipe holds, grown towards ``want`` where the system lets it (Linux: up to
    ``pipe-max-size`` without privileges)."""
    try:
        most = int(PIPE_MAX_SIZE.read_text())
    except (OSError, ValueError):
        most = 1 << 20  # Linux's default
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(want, most))
    except (AttributeError, OSError):  # above pipe-max-size, the user's pipe quota, not Linux
        try:
            return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        except (AttributeError, OSError):
            return select.PIPE_BUF  # what any pipe holds


@dataclass(frozen=True)
class _Ranges:
    target: Path
    ranges: list[tuple[int, int]]


def _turns(
    split: list[tuple[Path, FileRef, list[tuple[int, int]]]],
) -> Iterator[tuple[Path, tuple[int, int]]]:
    """Every shared file's ranges, one of each file in turn, as (target, range)."""
    for f, r in interleaved([_Ranges(t, rs) for t, _, rs in split]):
        yield f.target, r


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
        self._installs: list[Job] = []  # files shared by range: installed here at the end
        self._stopped = False
        self._first_error: BaseException | None = None

    @property
    def started(self) -> int:
        """The worker processes started (no more than there are ranges)."""
        return len(self._children)

    def start(self, jobs: list[Job]) -> None:
        lay = Fetcher(self.store, 1, self.part_size, self.verify)  # its ranges, its checks
        # no more processes than ranges in flight, which stay --concurrency in all
        work = plan(jobs, min(self.processes, self.concurrency), lay)
        self._installs = [(t, ref) for t, (ref, _) in work.shared.items()]
        try:
            tickets = Tickets(work.ranges) if work.ranges else None
        except OSError as e:  # the open files limit
            raise _cannot_start(e) from None
        each, extra = divmod(max(self.concurrency, len(work.plans)), len(work.plans))
        try:
            for i, p in enumerate(work.plans):
                self._children.append(self._fork(p, work, tickets, each + (i < extra)))
        except BaseException:
            self._stop()
            raise
        finally:
            if tickets is not None:  # the workers' now; its end tells them none are left
                tickets.close()

    def fetch_all(self, jobs: list[Job], progress: ByteProgress) -> None:
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
        for target, _ in self._installs:  # every range of it landed and verified
            os.replace(temporary(target), target)

    def _fork(self, mine: Plan, work: Work, tickets: Tickets | None, threads: int) -> _Child:
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        try:
            r, w = os.pipe()
        except OSError as e:
            raise _cannot_start(e) from None
        # Ctrl-C or SIGTERM between the fork and the child's own handling would unwind the
        # parent's stack in the child: both wait until each side is ready for them
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            pid = os.fork()
        except OSError as e:  # the container's pids limit, or memory
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(r)
            os.close(w)
            raise _cannot_start(e) from None
        if pid == 0:  # the child: never returns
            try:
                os.close(r)
                for sibling in self._children:  # their read ends: not ours to hold
                    os.close(sibling.fd)
                shared = Shared(work.shared, tickets.claim) if tickets is not None else None
                _child_main(self, mine.jobs, shared, threads, w, parent, blocked)
            finally:
                os._exit(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(w)
        return _Child(pid, r)

    def _wait(self, progress: ByteProgress) -> None:
        """Read every child's messages until each has closed its pipe; the first failure
        ends the others."""
        open_fds = {c.fd: c for c in self._children}
        poller = select.poll()
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        while open_fds:
            for fd, _ in poller.poll():
                if fd not in open_fds:
                    continue
                child = open_fds[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del open_fds[fd]
                    poller.unregister(fd)
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
        # A second Ctrl-C (or a SIGTERM) raised in the middle would leave the rest unkilled
        # and unreaped; blocking the signals would not do, as the kernel hands them to any
        # thread that does not block them (a progress bar's) and Python raises them here
        # anyway. So each step is done whatever is raised meanwhile, and the first such
        # exception is raised once every child is reaped (milliseconds: each was SIGKILLed).
        first: BaseException | None = None
        for step in (_kill, _reap):
            for child in self._children:
                first = _despite_signals(step, child, first)
        if first is not None:
            raise first


def _despite_signals(
    step: Callable[[_Child], None], child: _Child, first: BaseException | None
) -> BaseException | None:
    """``step(child)``, done again whenever a signal's exception (Ctrl-C, SIGTERM: not an
    ``Exception``) interrupts it; another exception ends it. The first exception raised."""
    while True:
        try:
            step(child)
            return first
        except Exception as e:
            return first or e
        except BaseException as e:
            first = first or e


def _kill(child: _Child) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGKILL)


def _reap(child: _Child) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(child.pid, 0)
    if child.fd >= 0:
        fd, child.fd = child.fd, -1  # closed once, even if this step runs again
        with contextlib.suppress(OSError):
            os.close(fd)


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
    procs: WorkerProcesses,
    jobs: list[Job],
    shared: Shared | None,
    threads: int,
    w: int,
    parent: int,
    mask: set,
) -> None:
    code = 1
    try:
        # dies with the parent, however the parent ends (not Linux: the parent still kills
        # us on a failure)
        import ctypes  # here: only a worker needs it, not the pull's cold path

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent ended before the line above
            os._exit(1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the parent set: just end
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        out = _PipeProgress(w)
        try:
            procs.store.after_fork()
            fetcher = Fetcher(procs.store, threads, procs.part_size, procs.verify)
            fetcher.fetch_all(jobs, out, shared)
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


__all__ = ["Plan", "Tickets", "Work", "WorkerProcesses", "plan"]
