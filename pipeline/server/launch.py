"""Listening and running: the socket, uvicorn, and SIGTERM's drain."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from pipeline.errors import InputError, PipelineError
from pipeline.server import fronts
from pipeline.server.app import create_app
from pipeline.server.loading import ServeOptions
from pipeline.server.service import Service

log = logging.getLogger("inf2_pipeline.serve")


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port or a wrong host is one line
    naming the option (uvicorn would log a traceback-like block and exit 1 or 3). IPv6 only
    for a host with ':', as uvicorn does: `localhost` is 127.0.0.1 even where it is also ::1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(
        family, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )  # TCP_NODELAY: asyncio sets it only then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except (OSError, UnicodeError, OverflowError) as e:
        sock.close()
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            raise InputError(
                f"--host {host} --port {port}",
                "cannot listen: in use by another process",
                "pick another --port",
            ) from None
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InputError(
            f"--host {host}",
            f"cannot listen there ({why})",
            "pass an address of this machine, e.g. 127.0.0.1 or 0.0.0.0",
        ) from None
    return sock


def serve(options: ServeOptions) -> None:
    """Run the server until SIGTERM/SIGINT; raises the load error if the release failed."""
    n = options.http_workers
    if n > 1 and not options.engine_process:  # each front would load a release of its own
        raise InputError(
            f"--http-workers {n}",
            "needs the engine in a process of its own, which every HTTP process talks to",
            "drop --no-engine-process, or serve with --http-workers 1",
        )
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler that was there
    # before it: this one, so that a clean drain exits 0 rather than dying by it. Taken over
    # before "listening" is said (a pod deleted while it starts sends SIGTERM as soon as it
    # may): one that comes before uvicorn starts is acted on at its startup. The engine's
    # process ignores it; the fronts inherit this one.
    fronts.PENDING.clear()
    before = signal.signal(signal.SIGTERM, fronts.remember)
    try:
        service, ends = _run(options, n)
    finally:
        signal.signal(signal.SIGTERM, before)
    if isinstance(service.failure, PipelineError):
        raise service.failure
    if service.failure is not None:
        raise PipelineError(f"serve {options.path}", service.error or "failed to load")
    if ends:  # a front that failed or was cut short during the drain
        raise PipelineError(f"serve {options.path}", "; ".join(ends))


def _run(options: ServeOptions, n: int) -> tuple[Service, list[str]]:
    """Listen, start the engine and the fronts, serve until the drain ends: the service and
    how each other front that did not exit 0 ended."""
    sock = _listen(options.host, options.port)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # uvicorn names its address only for sockets it binds itself; --port 0 needs the real one.
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    with fronts.shared_metrics() if n > 1 else contextlib.nullcontext():
        service = Service(options)
        if options.engine_process:  # forked now: before uvicorn's loop and threads exist
            service.spawn(close=[sock], fronts=n)
        others = fronts.fork(n - 1, lambda i: _front(service.front(i), sock))
        ends: list[str] = []
        try:
            _front(service.front(0), sock, others)
        finally:
            ends = fronts.reap(others, patient=service.failure is None)
            service.kill()  # whatever ended the server, the engine's process ends with it
            sock.close()
    return service, ends


def _front(service: Service, sock: socket.socket, others: Sequence[Any] = ()) -> int:
    """One HTTP process: uvicorn on the shared socket until it drains or the service fails;
    its exit status. Front 0 (``others``: the other fronts' processes) also passes its
    drain on to them, and fails when one of them ends on its own."""
    import uvicorn

    o = service.options
    config = uvicorn.Config(
        create_app(service),
        host=o.host,
        port=o.port,
        access_log=False,
        log_level="info",
        lifespan="on",
        timeout_keep_alive=5,
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            loop = asyncio.get_running_loop()
            if fronts.PENDING:  # SIGTERM (or ^C) came while this process was starting: exit
                # from the main loop, so that shutdown (the drain) runs as after a signal
                loop.call_soon(setattr, self, "should_exit", True)
            for proc in others:
                loop.add_reader(proc.sentinel, self.lost, loop, proc)

        def lost(self, loop: asyncio.AbstractEventLoop, proc: Any) -> None:
            loop.remove_reader(proc.sentinel)
            if service.process is not None:  # the engine's word first: a front may have
                service.process.read_pending()  # ended because the engine did
            if not self.should_exit and service.phase != "failed":
                service.engine_failed(fronts.ended(proc), "an HTTP process ended")

        async def shutdown(self, sockets: Any = None) -> None:
            service.drain()  # at once: take no new requests, finish the admitted ones
            fronts.terminate(others)
            await super().shutdown(sockets)

    server = Server(config)

    def failed() -> None:
        server.should_exit = True

    service.on_failure = failed
    server.run(sockets=[sock])
    return 1 if service.failure is not None else 0
