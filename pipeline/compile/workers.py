"""Compile workers as child processes: each in a process group of its own, so a kill
reaches the compilers it started (g++, neuronx-cc) too, and each told our pid, so it ends
its group if we die without killing it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

POLL_S = 0.05
KILL_GRACE_S = 3.0


def spawn_worker(spec: dict[str, Any], spec_file: Path, result_file: Path, log: Path):
    """Start a worker in its own process group (so a kill reaches its compilers too), told
    our pid so that it ends that group if we die without killing it (SIGKILL, OOM)."""
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(spec, indent=2))
    result_file.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    # The child imports what this process imports (tests register backends from tests/).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline.compile.worker",
                str(spec_file),
                str(result_file),
                "--parent",
                str(os.getpid()),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def kill_workers(*procs: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM every worker's process group at once; after one shared grace period SIGKILL
    whatever is left of each group (the worker, or compilers it started: g++, neuronx-cc).
    Bounded by ``grace_s`` plus a moment, however many workers there are."""
    groups = {p.pid for p in procs}  # each worker leads its own group (start_new_session)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while groups and time.monotonic() < deadline:
        for p in procs:
            p.poll()  # reap workers as they go, so their pids leave the groups
        groups = {g for g in groups if _group_exists(g)}
        if groups:
            time.sleep(POLL_S)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for p in procs:
        p.wait()


def _group_exists(pgid: int) -> bool:
    # Zombies still count until their parent (or init) reaps them: then we wait the
    # full grace, which is the bound anyway.
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def last_error(log: Path | None, code: int | None = None) -> str:
    """The worker's ``error:`` line, else its last line, else the exit status."""
    lines: list[str] = []
    if log and log.is_file():
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error: "):
            return ln.removeprefix("error: ")
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}" + (
            f"; last log line: {lines[-1]}" if lines else ""
        )
    tail = f": {lines[-1]}" if lines else ""
    return f"exit status {code}{tail}"
