"""A real S3 endpoint for tests: moto's standalone server, in its own process, on loopback.

Run as a script it serves until killed and prints ``port <N>`` once it listens. Tests use
``S3Server`` (started once per session by the ``s3_endpoint`` fixture in conftest.py) and talk
to it with real boto3 over HTTP.

moto checks a conditional write's precondition and then stores the object in two steps, with
no lock between them, so two simultaneous ``If-None-Match: *`` PUTs can both succeed there.
Real S3 evaluates a conditional write atomically (one of two concurrent writers gets 412 or
409). ``SerialConditionalWrites`` restores that documented behaviour by serialising requests
that carry a precondition; everything else runs concurrently as usual.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


class SerialConditionalWrites:
    """WSGI middleware: one conditional write (If-Match / If-None-Match) at a time."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict, start_response: Any) -> Any:
        conditional = environ.get("REQUEST_METHOD") in ("PUT", "POST") and (
            "HTTP_IF_MATCH" in environ or "HTTP_IF_NONE_MATCH" in environ
        )
        if not conditional:
            return self.app(environ, start_response)
        with self.lock:
            # Consume the response inside the lock: moto does the work while building it.
            return list(self.app(environ, start_response))


def serve(port: int = 0, *, atomic_conditions: bool = True) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app: Any = DomainDispatcherApplication(create_backend_app)
    if atomic_conditions:
        app = SerialConditionalWrites(app)
    server = make_server(HOST, port, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


class S3Server:
    """moto's server as a child process; ``url`` is its endpoint."""

    def __init__(self, *, atomic_conditions: bool = True) -> None:
        self.atomic_conditions = atomic_conditions
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> S3Server:
        args = [sys.executable, str(Path(__file__).resolve())]
        if not self.atomic_conditions:
            args.append("--racy")
        # moto's server logs every request to stderr; tests read nothing from it.
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "MOTO_CALL_RESET_API": "false"},
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""  # "" if it died
        if not line.startswith("port "):
            self.stop()
            raise RuntimeError(f"moto server did not start: {line!r}")
        self.url = f"http://{HOST}:{int(line.split()[1])}"
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


if __name__ == "__main__":
    serve(atomic_conditions="--racy" not in sys.argv[1:])
