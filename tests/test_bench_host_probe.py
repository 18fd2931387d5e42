"""bench/host_probe.py: where a server's processes spent a replay, read from the kernel's
own counts. Against a stand-in server: a sleeping parent (front 0, its main thread the
event loop) whose first child spins (the engine)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import host_probe

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")

STAND_IN = """
import os, sys, time
if os.fork() == 0:  # the engine: spins until killed with its parent
    while True:
        pass
print("ready", flush=True)
time.sleep(60)
"""


def test_a_spinning_engine_and_an_idle_front_are_told_apart():
    proc = subprocess.Popen(
        [sys.executable, "-c", STAND_IN], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 10
        while not host_probe.children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        before, t0 = host_probe.snapshot(proc.pid), time.monotonic()
        time.sleep(0.5)
        after = host_probe.snapshot(proc.pid)
        d = host_probe.delta(before, after, time.monotonic() - t0)
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
        proc.wait()
    roles = d["roles"]
    assert set(roles) == {"front0", "engine"}
    # the spinner ran or waited to run the whole time; the sleeper barely ran
    assert roles["engine"]["cpus"] + roles["engine"]["waiting_cpus"] > 0.5
    assert roles["front0"]["cpus"] < 0.1 and roles["engine"]["cpus"] > roles["front0"]["cpus"]
    assert 0 <= roles["front0"]["loop"]["on_cpu_share"] < 0.1
    assert d["machine_busy_cpus"] >= 0 and d["machine_steal_cpus"] >= 0
    line = host_probe.summary(d)
    assert "front loop on CPU" in line and "engine" in line


def test_no_server_measures_the_machine_alone_and_a_gone_process_is_skipped():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    snap = host_probe.snapshot(gone.pid)
    assert snap["procs"] == {"front0": {}} and snap["machine"]["busy"] > 0
    d = host_probe.delta(host_probe.snapshot(None), host_probe.snapshot(None), 1.0)
    assert d["roles"] == {} and host_probe.summary(None) == "host: not measured"


def test_the_host_s_python_speed_is_timed_and_shown():
    seconds = host_probe.python_speed(runs=1)
    assert 0 < seconds < 60
    assert f"python {seconds:.3f} s before" in host_probe.summary({"python_s": seconds})
