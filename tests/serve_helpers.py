"""A real ``inf2-pipeline serve`` process on a free loopback port, for tests and bench/."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


class ServerProcess:
    """``serve`` started with ``--port 0`` (the OS picks a free port; the log names it).

    Always stopped: ``stop()`` sends SIGTERM, then SIGKILL after a deadline; use as a
    context manager."""

    def __init__(
        self,
        release: Path,
        log: Path,
        *args: str,
        step_delay_s: float | None = None,
        env: dict[str, str] | None = None,
        entry: list[str] | None = None,
    ) -> None:
        """``step_delay_s``: every decode step of the server sleeps this long first
        (tests/serve_slow.py), so tests can act while requests are running. ``env``: more
        environment variables for the server. ``entry``: the command before ``serve``'s
        arguments, instead of the CLI (bench/bench_engine_host.py's simulated device)."""
        self.log = log
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, **(env or {}), PYTHONPATH=path, CI="true")
        main = "from pipeline.cli import main; main()"
        if step_delay_s is not None:
            env["INF2_TEST_STEP_DELAY_S"] = str(step_delay_s)
            main = "import tests.serve_slow; " + main
        cmd = entry or [sys.executable, "-c", main, "serve"]
        cmd += [str(release), "--port", "0", *args]
        # A file, not a pipe: a full pipe would block the server. Closed in stop().
        self._log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = ""
        self._terminated = False

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_listening(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log.read_text(errors="replace"))
            if m:
                self.url = f"http://{m.group(1)}:{m.group(2)}"
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.05)
        raise TimeoutError(f"serve did not listen in {timeout} s:\n{self.output()}")

    def wait_ready(self, timeout: float = 300) -> str:
        if not self.url:
            self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if get(self.url + "/ready")[0] == 200:
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        raise TimeoutError(f"serve was not ready in {timeout} s:\n{self.output()}")

    def terminate(self) -> None:
        """SIGTERM, once: a second one during the interpreter's exit (when Python has put
        the default handlers back) would kill the process by the signal."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60) -> int:
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def get(url: str, timeout: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def post(
    url: str, body: dict[str, Any], timeout: float = 120, headers: dict[str, str] | None = None
) -> tuple[int, dict, Any]:
    """(status, JSON body, headers)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers


def metric(text: str, name: str, **labels: str) -> float:
    """The sum over every sample of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
