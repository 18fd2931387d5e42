"""Where a host's CPUs went while a replay ran: the whole machine's (busy, stolen by the
hypervisor) and each server process's (on a CPU, runnable but waiting for one).

Why: on the twenty-sixth round's H100 host (a Firecracker VM) the HTTP front's event loop was
late by 11-37 ms at its p99 where the round before, same code, had 3-6 ms, and that host ran
the same Python 1.8-2.3x slower. A late loop is either busy (its thread on a CPU the whole
time), preempted (runnable, waiting for a CPU: other processes, or vCPUs the hypervisor took
back, which /proc/stat counts as steal), or both. The kernel counts each apart, so one replay
tells which, without a profiler on the device.

Linux only: ``/proc/stat`` (per-CPU jiffies, steal the 8th), ``/proc/PID/task/TID/schedstat``
(ns on a CPU, ns waiting on a run queue, slices), ``/proc/PID/task/TID/status``
(``nonvoluntary_ctxt_switches``). Elsewhere every figure is None.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # a thread or process that ended between listing and reading
        return None


def machine() -> dict[str, float] | None:
    """Seconds summed over CPUs since boot: busy (user, nice, system, irq, softirq), idle
    (idle, iowait), steal (time the hypervisor ran something else on a vCPU)."""
    text = _read(PROC / "stat")
    if text is None:
        return None
    f = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    f += [0] * (8 - len(f))
    user, nice, system, idle, iowait, irq, softirq, steal = f[:8]
    return {
        "busy": (user + nice + system + irq + softirq) / TICK,
        "idle": (idle + iowait) / TICK,
        "steal": steal / TICK,
    }


def children(pid: int) -> list[int]:
    """``pid``'s direct children, oldest first (the kernel's own list when it has one)."""
    text = _read(PROC / str(pid) / "task" / str(pid) / "children")
    if text is not None:
        return [int(c) for c in text.split()]
    kids = []
    for p in PROC.iterdir():
        if p.name.isdigit():
            stat = _read(p / "stat")
            if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(p.name))
    return sorted(kids)


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children(p)
    return out


def threads(pid: int) -> dict[int, dict[str, Any]]:
    """Each live thread of ``pid``: its name, seconds on a CPU, seconds runnable but waiting
    for one, involuntary switches (the scheduler took its CPU away)."""
    out: dict[int, dict[str, Any]] = {}
    try:
        tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
    except OSError:
        return out
    for tid in tids:
        base = PROC / str(pid) / "task" / str(tid)
        sched, status = _read(base / "schedstat"), _read(base / "status")
        if sched is None or status is None:
            continue
        run_ns, wait_ns, *_ = (int(x) for x in sched.split())
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out[tid] = {
            "name": fields.get("Name", "").strip(),
            "cpu_s": run_ns / 1e9,
            "wait_s": wait_ns / 1e9,
            "involuntary": int(fields.get("nonvoluntary_ctxt_switches", "0")),
        }
    return out


def snapshot(server_pid: int | None) -> dict[str, Any]:
    """The machine, and each process of the server's tree with its threads. Roles follow
    ``serve``'s fork order (pipeline/server/fronts.py): the server's own process is front 0
    (its main thread the event loop), its first child the engine's process, later children
    fronts 1..N-1; anything further down counts with its ancestor's role."""
    procs: dict[str, dict[int, dict[str, Any]]] = {}
    if server_pid is not None:
        procs["front0"] = threads(server_pid)
        for i, child in enumerate(children(server_pid)):
            role = "engine" if i == 0 else f"front{i}"
            merged = threads(child)
            for d in descendants(child):
                merged.update(threads(d))
            procs[role] = merged
    return {"machine": machine(), "procs": procs, "main_tid": server_pid}


def _sum(ts: dict[int, dict[str, Any]], key: str, only: set[int] | None = None) -> float:
    return sum(t[key] for tid, t in ts.items() if only is None or tid in only)


def delta(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """Per second of ``wall``: the machine's busy and stolen CPUs, and for each server role
    its CPUs in use and waiting (threads present at both ends); for front 0's event loop
    (its main thread) also the share of the wall it ran, waited, and its involuntary
    switches a second. Processes that started in between are left out."""
    out: dict[str, Any] = {"wall_s": wall}
    m0, m1 = before["machine"], after["machine"]
    if m0 and m1 and wall > 0:
        total = sum(m1.values()) - sum(m0.values())
        cpus = os.cpu_count() or 1
        out["machine_busy_cpus"] = (m1["busy"] - m0["busy"]) / wall
        out["machine_steal_cpus"] = (m1["steal"] - m0["steal"]) / wall
        out["machine_steal_share"] = (m1["steal"] - m0["steal"]) / total if total > 0 else None
        out["machine_cpus"] = cpus
    roles: dict[str, Any] = {}
    for role, t1 in after["procs"].items():
        t0 = before["procs"].get(role, {})
        both = set(t0) & set(t1)
        if not both or wall <= 0:
            continue
        d = {k: _sum(t1, k, both) - _sum(t0, k, both) for k in ("cpu_s", "wait_s", "involuntary")}
        roles[role] = {
            "threads": len(both),
            "cpus": d["cpu_s"] / wall,
            "waiting_cpus": d["wait_s"] / wall,
            "involuntary_per_s": d["involuntary"] / wall,
        }
    main = after.get("main_tid")
    f0, f1 = before["procs"].get("front0", {}), after["procs"].get("front0", {})
    if main in f0 and main in f1 and wall > 0:
        a, b = f0[main], f1[main]
        roles.setdefault("front0", {})["loop"] = {
            "on_cpu_share": (b["cpu_s"] - a["cpu_s"]) / wall,
            "waiting_share": (b["wait_s"] - a["wait_s"]) / wall,
            "involuntary_per_s": (b["involuntary"] - a["involuntary"]) / wall,
        }
    out["roles"] = roles
    return out


def python_speed(runs: int = 3) -> float:
    """Seconds for ``sum(range(10_000_000))`` in this process, best of ``runs``: how fast the
    host runs one Python thread just then. The thirty-third round's host took 0.125 s at its
    session's start and 0.273 s at one replay's end, and that replay's TTFT p99 was twice
    the rounds' before; taken before each replay, it tells a slow host from a slow server."""
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        sum(range(10_000_000))
        best = min(best, time.perf_counter() - t)
    return best


def own_usage() -> dict[str, float]:
    """This process's CPU seconds and involuntary switches, its ended threads included (a
    client process reports them before it exits)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": r.ru_utime + r.ru_stime, "involuntary": float(r.ru_nivcsw)}


def summary(d: dict[str, Any] | None, label: str = "host: ") -> str:
    """One line for a way's log: the machine, the front's loop, the engine, the clients."""
    if not d:
        return label + "not measured"
    parts = []
    if d.get("python_s") is not None:
        parts.append(f"python {d['python_s']:.3f} s before")
    if d.get("machine_busy_cpus") is not None:
        parts.append(
            f"machine busy {d['machine_busy_cpus']:.1f} of {d['machine_cpus']} CPUs, "
            f"steal {d['machine_steal_cpus']:.2f}"
        )
    roles = d.get("roles", {})
    loop = roles.get("front0", {}).get("loop")
    if loop:
        parts.append(
            f"front loop on CPU {loop['on_cpu_share']:.0%}, waiting {loop['waiting_share']:.1%},"
            f" {loop['involuntary_per_s']:.0f} preemptions/s"
        )
    for role, r in roles.items():
        parts.append(f"{role} {r['cpus']:.2f} CPUs (+{r['waiting_cpus']:.2f} waiting)")
    clients = d.get("clients")
    if clients:
        parts.append(
            f"clients {clients['cpus']:.2f} CPUs, {clients['involuntary_per_s']:.0f} preemptions/s"
        )
    return label + "; ".join(parts)
