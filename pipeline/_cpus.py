"""How many CPUs this process may use: what the pull's threads and serve's HTTP fronts are
sized by. Its affinity, capped by a cgroup CPU quota (a pod's ``limits.cpu``), which
affinity does not show: a container with a 2-CPU limit on a 192-vCPU node counts 2."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cpus(cgroup: Path = CGROUP) -> float:
    """Affinity, capped by the quota of cgroup v2 (``cpu.max``: "QUOTA PERIOD" or "max
    PERIOD"), else v1 (``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``; -1: none); a
    fraction where the quota is one."""
    try:
        cpus: float = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = None
    with contextlib.suppress(OSError, ValueError):
        q, period = (cgroup / "cpu.max").read_text().split()[:2]
        quota = None if q == "max" else int(q) / int(period)
    if quota is None:
        with contextlib.suppress(OSError, ValueError):
            q = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
            period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
            quota = q / period if q > 0 and period > 0 else None
    return min(cpus, quota) if quota else cpus
