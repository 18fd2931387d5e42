"""Progress reporting: a rich bar on a terminal, quiet (plain lines at most) in CI."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


def interactive() -> bool:
    """A progress bar only where a person watches: a TTY and not CI."""
    return sys.stderr.isatty() and os.environ.get("CI", "").lower() not in ("1", "true", "yes")


class ByteProgress:
    """Thread-safe enough for ``advance`` from worker threads (rich locks internally)."""

    def __init__(self, progress: Progress | None, task: int | None) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)


@contextmanager
def byte_progress(description: str, total: int) -> Iterator[ByteProgress]:
    if not interactive():
        yield ByteProgress(None, None)
        return
    # Imported here: rich's progress costs ~35 ms of an init container's start, for no bar.
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        yield ByteProgress(progress, progress.add_task(description, total=total))
