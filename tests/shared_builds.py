"""What a test run builds once, shared by pytest-xdist's workers."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that ``build`` fills once per test run. `make test` runs pytest-xdist
    workers: they share the folder, the first to ask builds it under a lock and the others
    wait for it, so a release is compiled once, not once a worker (each compile keeps both
    cores of a 2-core machine busy for a minute or more). Read-only to its users."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        root = factory.mktemp(name)
        build(root)
        return root
    run = factory.getbasetemp().parent  # this run's folder; each worker's basetemp is in it
    root, done = run / name, run / f"{name}.built"
    with open(run / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed building it
            root.mkdir()
            build(root)
            done.touch()
    return root
