"""Child process entry point:
``python -m pipeline.compile.worker SPEC.json RESULT.json [--parent PID]``.

Each bucket (and the once-per-run ``prepare`` step) compiles in its own process so the
runner can run several at once, enforce a timeout, kill the whole process group on Ctrl-C,
and keep one log per bucket (this process's stdout and stderr). RESULT.json is written,
through a temporary name, only on success.

With ``--parent PID`` (the runner always passes its pid) the worker dies with the runner,
however the runner dies (SIGKILL, OOM kill): the kernel sends it ``PARENT_DEATH_SIGNAL``
(``PR_SET_PDEATHSIG``, Linux), and a thread watching ``getppid()`` backs that up; either
SIGKILLs the worker's process group, so the compilers it started end with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from pipeline._files import atomic_write_text
from pipeline.compile.backends import load_backend
from pipeline.compile.backends.base import BucketJob
from pipeline.errors import PipelineError


def run(spec: dict) -> dict:
    backend = load_backend(spec["backend"])
    if spec["kind"] == "prepare":
        out_dir = Path(spec["out_dir"])
        files = backend.prepare(Path(spec["model_dir"]), spec["dtype"], out_dir)
        return {"files": {k: str(v) for k, v in files.items()}, "meta": {}}
    job = BucketJob.from_dict(spec["job"])
    out = backend.compile(job)
    missing = [k for k, p in out.files.items() if not Path(p).is_file()]
    if missing:
        raise PipelineError(
            f"bucket {job.bucket.name}", f"backend reported files it did not write: {missing}"
        )
    return {"files": {k: str(v) for k, v in out.files.items()}, "meta": out.meta}


PARENT_DEATH_SIGNAL = signal.SIGHUP  # workers have no terminal: nothing else sends it
WATCH_S = 0.25  # how often the fallback thread looks at getppid()
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """End this process's group as soon as ``parent`` is no longer our parent.

    The kernel's parent-death signal is immediate but Linux-only, and it fires when the
    parent *thread* that forked us exits; the watch thread covers the rest (other systems,
    a signal handler the main thread cannot run while stuck in C code). Checking
    ``getppid()`` after arming the signal closes the race with a parent that died before.
    """
    # An inherited "ignore" (a job started in the background) must not keep us alive.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(PARENT_DEATH_SIGNAL, lambda *_: end_group())
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    if os.getppid() != parent:
        end_group()
    threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True).start()


def _watch(parent: int) -> None:
    # An orphan's parent becomes init or a subreaper, never the dead parent's pid again.
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    end_group()


def end_group() -> None:
    """SIGKILL this process's group (its compilers) and this process. Only a group this
    process leads (the runner starts each worker in a new session): never the caller's."""
    with contextlib.suppress(OSError):
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[2] == "--parent":
        die_with_parent(int(argv[3]))
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    print(f"[worker] {spec['kind']} {spec.get('name', '')} with {spec['backend']}", flush=True)
    start = time.monotonic()
    try:
        result = run(spec)
    except PipelineError as e:
        traceback.print_exc()
        print(f"error: {e.one_line()}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        traceback.print_exc()
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    result["seconds"] = round(time.monotonic() - start, 3)
    atomic_write_text(result_path, json.dumps(result, indent=2))
    print(f"[worker] done in {result['seconds']}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
