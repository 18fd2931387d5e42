"""Finding live processes, for tests that check that nothing outlives them."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; only a running process counts. The state follows
    # the command name, which is in parentheses and may hold spaces.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def live_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose argv contains ``marker``."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            argv = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in argv and alive(int(d.name)):
            pids.append(int(d.name))
    return pids
