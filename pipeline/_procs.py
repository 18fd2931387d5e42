"""Processes we start never outlive us: the child side of that rule.

A child calls ``die_with_parent(parent_pid)`` first thing. However the parent dies (SIGKILL,
OOM kill), the kernel sends the child ``PARENT_DEATH_SIGNAL`` (``PR_SET_PDEATHSIG``, Linux),
and a thread watching ``getppid()`` backs that up; either ends the child (and the process
group it leads, if it leads one: the processes it started).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any

PARENT_DEATH_SIGNAL = signal.SIGHUP  # our children have no terminal: nothing else sends it
WATCH_S = 0.25  # how often the fallback thread looks at getppid()
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """End this process (and the group it leads) as soon as ``parent`` is no longer our
    parent.

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


def killed_with_parent(parent: int) -> None:
    """The kernel's parent-death signal alone, as SIGKILL, and no watch thread: for a
    process forked by a server before its threads exist (the engine's, an HTTP front), which
    holds nothing to clean up. Linux only, as the server's forks are."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the call took effect
        os._exit(0)


def how_it_ended(proc: Any) -> str:
    """A forked ``multiprocessing`` child that has ended, in words for a one-line error:
    "was killed by signal 9", "exited (1)"."""
    proc.join(1.0)
    code = proc.exitcode
    return f"was killed by signal {-code}" if code and code < 0 else f"exited ({code})"


def _watch(parent: int) -> None:
    # An orphan's parent becomes init or a subreaper, never the dead parent's pid again.
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    end_group()


def end_group() -> None:
    """SIGKILL this process's group (what it started) and this process. Only a group this
    process leads: never the caller's."""
    with contextlib.suppress(OSError):
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


__all__ = [
    "PARENT_DEATH_SIGNAL",
    "WATCH_S",
    "die_with_parent",
    "end_group",
    "how_it_ended",
    "killed_with_parent",
]
