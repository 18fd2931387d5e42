"""Worker processes for ``pull`` on many-core nodes: ``python -m pipeline.install.pull_procs``.

One process's threads top out near two cores (botocore reading bodies and the per-range
Python work hold the GIL), so on a node with more CPUs the ranges are landed by several
processes. The parent keeps everything else (the queue of ranges, progress, resume
bookkeeping, whole-file checks, the install): each of its threads hands one range to the
least busy worker and waits for the answer, so ranges in flight across all processes stay
at most ``concurrency`` and memory stays bounded as with threads alone. While no worker is
ready (they take a few hundred ms to import boto3 and open a client), the parent's threads
land ranges themselves, so starting the workers costs no wall time.

A worker opens its own store from ``S3Store.reopen_kwargs()`` (never a client made before
the process existed), reads jobs (pickled ``RangeJob``\\s, length-prefixed) on stdin, lands
each on one of its threads with ``land_range`` into the temporary file it opens itself, and
answers on stdout. It ends at EOF on stdin (the pull is done, or failed, or was stopped),
and with the pull however the pull dies (``pipeline._procs.die_with_parent``). It ignores
SIGINT: Ctrl-C reaches the whole process group, and the parent stops its workers itself.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import IO, Any

from pipeline.errors import PipelineError

_HEADER = struct.Struct("<Q")
STOP_S = 2.0  # how long stopping waits for workers to exit before SIGKILL
# While no worker is ready, the caller lands a range itself (tests turn this off to make
# the workers land every range).
LAND_WHILE_STARTING = True
# At most this many ranges are landed by the pull process itself at a time (while the
# workers start): its buffers then stay a few ranges, not concurrency × range size on top
# of the workers'.
LOCAL_LANDERS = 4
# The directory holding the ``pipeline`` package, so workers import the same code.
_ROOT = str(Path(__file__).resolve().parents[2])


def _send(f: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _recv(f: IO[bytes]) -> Any:
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None  # EOF
    (n,) = _HEADER.unpack(head)
    return pickle.loads(f.read(n))


def _error_to_wire(e: BaseException) -> tuple:
    if isinstance(e, PipelineError):
        return (type(e), e.what, e.why, e.hint)
    return (PipelineError, "pull worker", f"{type(e).__name__}: {e}", None)


def _error_from_wire(wire: tuple) -> PipelineError:
    cls, what, why, hint = wire
    try:
        return cls(what, why, hint)
    except TypeError:  # a subclass with another signature
        return PipelineError(what, why, hint)


class _Worker:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.busy = 0
        self.ready = False  # it has opened its store and takes jobs
        self.peak_rss = 0
        self.pending: dict[int, Future] = {}
        self.write_lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="pull-proc-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while (msg := _recv(self.proc.stdout)) is not None:
                job_id, ok, value, rss = msg
                self.peak_rss = max(self.peak_rss, rss)
                if job_id is None:
                    self.ready = True
                    continue
                fut = self.pending.pop(job_id)
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(_error_from_wire(value))
        except (OSError, EOFError, pickle.UnpicklingError, ValueError):
            pass
        # The worker is gone: whatever it still had will never be answered.
        rc = self.proc.wait()
        for fut in list(self.pending.values()):
            with contextlib.suppress(Exception):
                fut.set_exception(
                    PipelineError(
                        f"pull worker process {self.proc.pid}",
                        f"exited with status {rc} before landing its ranges",
                        "run the pull again: it resumes from the verified parts",
                    )
                )


class WorkerPool:
    """``processes`` worker processes with ``threads`` threads each."""

    def __init__(self, store_kwargs: dict[str, Any], processes: int, threads: int) -> None:
        self.threads = threads
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stopped = False
        self._local = 0  # ranges the pull process is landing itself now
        self.workers: list[_Worker] = []
        try:
            for _ in range(processes):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pipeline.install.pull_procs", str(os.getpid()),
                     str(threads)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                )  # fmt: skip
                assert proc.stdin is not None
                _send(proc.stdin, store_kwargs)
                self.workers.append(_Worker(proc))
        except BaseException:
            self.stop()
            raise

    def landed_here(self) -> None:
        """A range that ``call`` left to the caller has landed (or failed)."""
        with self._lock:
            self._local -= 1

    @property
    def peak_rss(self) -> int:
        """The sum of the workers' peak resident sets."""
        return sum(w.peak_rss for w in self.workers)

    def call(self, job: Any) -> Any:
        """Land ``job`` on the least busy worker; its answer, or its error raised here.
        None while no worker is ready with a free thread (they are still starting: a second
        or so of imports) and fewer than ``LOCAL_LANDERS`` ranges are being landed here:
        the caller lands it itself meanwhile, then calls ``landed_here``."""
        while True:
            with self._lock:
                if self._stopped:
                    raise InterruptedError
                free = [w for w in self.workers if w.ready and w.busy < self.threads]
                if free:
                    w = min(free, key=lambda w: w.busy)
                    w.busy += 1
                    job_id = next(self._ids)
                    fut: Future = Future()
                    w.pending[job_id] = fut
                    break
                if LAND_WHILE_STARTING and self._local < LOCAL_LANDERS:
                    self._local += 1
                    return None
            if all(w.proc.poll() is not None for w in self.workers):
                raise PipelineError("pull worker processes", "all exited before starting")
            time.sleep(0.01)
        try:
            try:
                assert w.proc.stdin is not None
                with w.write_lock:
                    _send(w.proc.stdin, (job_id, job))
            except OSError:  # it died: its reader fails the future
                pass
            while True:
                try:
                    return fut.result(timeout=1.0)
                except FutureTimeout:
                    if w.proc.poll() is not None and not w.reader.is_alive():
                        w.pending.pop(job_id, None)
                        raise PipelineError(
                            f"pull worker process {w.proc.pid}",
                            f"exited with status {w.proc.returncode}",
                            "run the pull again: it resumes from the verified parts",
                        ) from None
        finally:
            with self._lock:
                w.busy -= 1

    def stop(self) -> None:
        """End every worker: EOF on its stdin, then SIGKILL after ``STOP_S``; one still
        starting (it holds nothing yet) at once."""
        with self._lock:
            self._stopped = True
        for w in self.workers:
            with contextlib.suppress(OSError):
                assert w.proc.stdin is not None
                w.proc.stdin.close()
            if not w.ready:
                w.proc.kill()
        for w in self.workers:
            try:
                w.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for w in self.workers:
            w.reader.join(STOP_S)
            if w.proc.stdout is not None:
                with contextlib.suppress(OSError):
                    w.proc.stdout.close()


def _peak_rss() -> int:
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return 0


def main(argv: list[str]) -> int:
    from pipeline._procs import die_with_parent

    die_with_parent(int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threads = int(argv[1])
    jobs = os.fdopen(0, "rb")
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not corrupt the answers
    store_kwargs = _recv(jobs)
    if store_kwargs is None:
        return 0

    from pipeline.install.pull import land_range
    from pipeline.store.s3 import S3Store

    store = S3Store(**store_kwargs)
    lock = threading.Lock()
    _send(answers, (None, True, None, _peak_rss()))  # ready

    def land(job_id: int, job: Any) -> None:
        try:
            fd = os.open(job.tmp, os.O_RDWR)
            try:
                answer = (job_id, True, land_range(store, job, fd), _peak_rss())
            finally:
                os.close(fd)
        except BaseException as e:
            answer = (job_id, False, _error_to_wire(e), _peak_rss())
        with lock:
            _send(answers, answer)

    pool = ThreadPoolExecutor(threads)
    while (msg := _recv(jobs)) is not None:
        pool.submit(land, *msg)
    # EOF: the pull is done, or is stopping us; what is still in flight is not wanted.
    answers.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
