"""Several HTTP processes in front of the one engine (``serve --http-workers N``).

Why: one event loop sends every SSE event, one socket write each. On the H200's current
replay that is ~9,000 events a second, and a finished row waits for its client's next
request behind that loop (bench/RESULTS.md, seventeenth round). N fronts share the
listening socket (the kernel hands each connection to one of them, as uvicorn's and
gunicorn's own workers do) and each has its own socket pair to the engine's process
(``engine_process.EngineProcess.fork(fronts=N)``). vLLM makes the same cut with
``--api-server-count``: several API server processes in front of one engine core, their
Prometheus metrics summed through ``prometheus_client``'s multiprocess mode. Measured since
(eighteenth round): on the H200's 16-core host at 32 clients, 4 fronts gave 1.01× one
front's tokens/s, so the loop was not that replay's limit and the default stays 1.

The process ``serve`` runs in is front 0: it forks the engine first, then fronts 1..N-1
(before any event loop or thread exists), forwards SIGTERM to them when it drains, and
fails (exit 1) when one of them ends on its own, as when the engine dies. Each front
drains its own streams; the engine finishes what every front admitted before it stops.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from pipeline._cpus import usable_cpus
from pipeline._environ import environ_set
from pipeline._procs import how_it_ended, killed_with_parent

JOIN_S = 10.0  # after front 0 failed, how long the others may take to end
METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"
# ``--http-workers auto``'s most: on the 16-core H100 host 4 fronts kept each loop at
# 23-25 % of a core at 12,300-12,500 tokens/s (one alone: 64-68 %), bench/RESULTS.md,
# twenty-seventh round; more fronts only add processes
AUTO_MOST = 4


def auto_count(backend: str, engine_process: bool, cpus: float | None = None) -> int:
    """``--http-workers auto``: one front per two usable CPUs, 1 to ``AUTO_MOST``; one where
    fronts cannot help or would take the model's CPUs.

    Why more than one where cores allow: one front's event loop writes every stream's
    events, ~65 % of a fast core at 12,000 tokens/s, so a host whose cores run Python
    half as fast saturates it, and every first token waits behind that loop (the
    twenty-sixth round's host: loop lag p99 11-37 ms; the twenty-seventh's, 2-5 ms).
    Four fronts gave 1.01-1.03x the tokens/s and a TTFT p50 of 4.7 ms against 6.0-6.1
    there. One on the cpu backend (the model's own threads want the cores; a test and
    parity path) and without the engine's own process (which fronts need)."""
    if backend == "cpu" or not engine_process:
        return 1
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, min(AUTO_MOST, int(cpus // 2)))


@contextlib.contextmanager
def shared_metrics() -> Iterator[str]:
    """Every process's metrics in files of one temporary folder, summed at ``/metrics``
    (``prometheus_client.multiprocess``). Entered before the first metric exists: the client
    picks its value class from the environment at import, so it is picked again here."""
    from prometheus_client import values

    folder = tempfile.mkdtemp(prefix="inf2-serve-metrics-")
    was = values.ValueClass
    try:
        with environ_set(METRICS_DIR, folder):
            values.ValueClass = values.get_value_class()
            yield folder
    finally:
        values.ValueClass = was
        shutil.rmtree(folder, ignore_errors=True)


def fork(n: int, run: Callable[[int], int]) -> list[Any]:
    """Fronts 1..n: each a forked process running ``run(i)`` (its exit status), killed by the
    kernel if this one dies."""
    ctx = multiprocessing.get_context("fork")
    parent = os.getpid()
    procs = []
    for i in range(1, n + 1):
        proc = ctx.Process(
            target=_front_main, args=(run, i, parent), name=f"inf2-serve-http-{i}", daemon=True
        )
        proc.start()
        procs.append(proc)
    return procs


PENDING: list[int] = []  # signals that came before uvicorn took them over (startup reads it)


def remember(signum: int, frame: Any = None) -> None:
    """SIGTERM's (and a front's SIGINT's) handler outside uvicorn's own: one that came
    before uvicorn started is acted on at its startup, and the one uvicorn raises again
    after its drain exits 0 rather than killing the process (or a traceback from
    multiprocessing, for a SIGINT)."""
    PENDING.append(signum)


def _front_main(run: Callable[[int], int], i: int, parent: int) -> None:
    killed_with_parent(parent)
    signal.signal(signal.SIGINT, remember)  # ^C reaches the whole group: each front drains
    raise SystemExit(run(i))


def ended(proc: Any) -> str:
    """How a front's process ended, for the server's one line."""
    return f"the HTTP process {proc.name} (pid {proc.pid}) {how_it_ended(proc)}"


def terminate(procs: list[Any]) -> None:
    """Front 0 drains: the others drain too."""
    for proc in procs:
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)


def reap(procs: list[Any], patient: bool) -> list[str]:
    """Front 0 is done, so the engine has stopped: the others finish their streams
    (``patient``: as long as that takes, as uvicorn's own drain does; else ``JOIN_S``, then
    they are killed). How each that did not exit 0 ended."""
    ends = []
    for proc in procs:
        proc.join(None if patient else JOIN_S)
        if proc.is_alive():
            proc.kill()
        if proc.exitcode != 0:
            ends.append(ended(proc))
    return ends
