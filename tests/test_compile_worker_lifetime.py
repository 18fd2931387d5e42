"""A compile worker ends its process group when its parent dies, by either of its two means:
the kernel's parent-death signal and the getppid() watch thread, each tested alone.

Each test builds parent → worker (own session, as the runner starts it) → "compiler", SIGKILLs
the parent, and polls until nothing with the test's marker in its argv is alive.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.proc_helpers import live_with as _live_with

REPO = Path(__file__).resolve().parent.parent
# argv: parent pid, mode, marker dir. Starts a "compiler" in its group, then says "ready".
WORKER = """
import signal, subprocess, sys, time
from pathlib import Path
from pipeline import _procs as worker  # what pipeline.compile.worker uses
parent, mode, marker = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
if mode == "signal":
    worker.WATCH_S = 3600  # the watch thread looks once, then sleeps: only the signal acts
worker.die_with_parent(parent)
if mode == "watch":
    signal.signal(worker.PARENT_DEATH_SIGNAL, signal.SIG_IGN)  # only the watch thread acts
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", str(marker)])
(marker / "ready").write_text("ready")
time.sleep(3600)
"""
PARENT = """
import os, subprocess, sys
subprocess.Popen(
    [sys.executable, "-c", sys.argv[1], str(os.getpid()), *sys.argv[2:]], start_new_session=True
).wait()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _gone_within(marker: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while _live_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _live_with(marker)


def _kill_all(marker: str) -> None:
    for pid in _live_with(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["signal", "watch"])
def test_worker_and_its_compiler_end_when_the_parent_is_sigkilled(tmp_path, mode):
    marker = str(tmp_path)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, WORKER, mode, marker], env=_env())
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            assert parent.poll() is None
            time.sleep(0.05)
        # parent, worker, compiler
        assert len(_live_with(marker)) == 3
        parent.kill()
        parent.wait()
        # At once (the signal) or within WATCH_S (0.25 s); 20 s is slack for a loaded box.
        assert _gone_within(marker, 20) == []
    finally:
        parent.kill()
        _kill_all(marker)


def test_worker_whose_parent_died_before_it_started_ends_at_once(tmp_path):
    """The race the getppid() check closes: the parent died before the signal was armed."""
    marker = str(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(dead.pid), "signal", marker],
        env=_env(),
        start_new_session=True,
    )
    try:
        assert worker.wait(timeout=60) == -signal.SIGKILL
        assert not (tmp_path / "ready").exists()  # it never started its compiler
    finally:
        worker.kill()
        _kill_all(marker)


def test_worker_outside_a_group_of_its_own_kills_only_itself(tmp_path):
    """Run by hand (no new session), it must not take the caller's process group along."""
    marker = str(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(dead.pid), "signal", marker], env=_env()
    )
    assert worker.wait(timeout=60) == -signal.SIGKILL  # and this test is still running
