"""A fault-injecting HTTP proxy for tests: forwards every request to an upstream endpoint
(moto's server) and corrupts chosen responses, as a flaky network or disk could.

``FaultProxy(upstream, corrupt=rule, times=1)``: ``rule(method, path, headers)`` picks the
responses whose body gets one byte flipped (in the middle), at most ``times`` times
(``times=None``: always). ``hits`` lists the (method, path, range) of every corrupted one.
``delay`` seconds hold every ranged GET (a slow network); ``ranges_served`` counts those answered.
It listens on 127.0.0.1 in a thread of the test process and stops with the ``with`` block.

Other faults for the responses the rule picks (``fault=``): ``"reset"`` (the connection is
reset before any reply), ``"truncate"`` (half the body, then the connection closes), or an
HTTP status (503, 403, 500: S3's error document for it, e.g. 503 SlowDown), or ``"none"``
(the picked requests are only listed in ``hits``). ``keepalive=False``
closes every connection after its reply without saying so (as a server dropping idle
keep-alive connections does); ``connections`` counts the connections accepted. ``tls``:
(certfile, keyfile) to serve HTTPS. A request in absolute form (``GET http://host/path``, as
sent to an HTTP proxy) is forwarded too, so it can stand in for a forward proxy.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

Rule = Callable[[str, str, Mapping[str, str]], bool]
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}
S3_ERRORS = {
    301: ("PermanentRedirect", "The bucket you are attempting to access must be addressed..."),
    403: ("AccessDenied", "Access Denied"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        corrupt: Rule,
        times: int | None = 1,
        delay: float = 0.0,
        *,
        fault: str | int = "corrupt",
        keepalive: bool = True,
        tls: tuple[str, str] | None = None,
    ) -> None:
        self.upstream = urlsplit(upstream)
        self.corrupt, self.times, self.delay = corrupt, times, delay
        self.fault, self.keepalive = fault, keepalive
        self.ranges_served = self.connections = 0
        self.hits: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._server.handle_error = lambda *_: None  # type: ignore[method-assign]  # resets, refused TLS
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            # The handshake happens in the handler's thread (a failed one must not stop us).
            self._server.socket = context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def _should_corrupt(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        with self._lock:
            if self.times is not None and len(self.hits) >= self.times:
                return False
            if not self.corrupt(method, path, headers):
                return False
            self.hits.append((method, path, headers.get("Range")))
            return True

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:  # quiet
                pass

            def setup(self) -> None:
                if isinstance(self.request, ssl.SSLSocket):
                    try:
                        self.request.do_handshake()
                    except (OSError, ssl.SSLError):
                        self.request.close()
                        raise
                with proxy._lock:
                    proxy.connections += 1
                super().setup()

            def handle_one_request(self) -> None:
                super().handle_one_request()
                if not proxy.keepalive:
                    self.close_connection = True  # said nowhere in the reply

            def _reset(self) -> None:
                # SO_LINGER 0: close sends RST, not FIN (a connection reset by peer)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))  # fmt: skip
                self.close_connection = True

            def _s3_error(self, status: int) -> None:
                code, message = S3_ERRORS.get(status, (str(status), "error"))
                body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                path = self.path
                if "://" in path:  # absolute form: we are someone's HTTP proxy
                    target = urlsplit(path)
                    path = f"{target.path}?{target.query}" if target.query else target.path
                faulty = proxy.fault != "corrupt" and proxy._should_corrupt(
                    self.command, self.path, self.headers
                )
                if faulty and proxy.fault == "reset":
                    return self._reset()
                if faulty and isinstance(proxy.fault, int):
                    return self._s3_error(proxy.fault)
                truncate = faulty and proxy.fault == "truncate"
                up = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=60
                )
                try:
                    up.request(self.command, path, body=body, headers=headers)
                    resp = up.getresponse()
                    data = resp.read()
                    out_headers = resp.getheaders()
                    status = resp.status
                finally:
                    up.close()
                if (
                    data
                    and proxy.fault == "corrupt"
                    and proxy._should_corrupt(self.command, self.path, self.headers)
                ):
                    mid = len(data) // 2
                    data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]
                self.send_response(status)
                head = self.command == "HEAD"  # keeps upstream's Content-Length, sends no body
                for k, v in out_headers:
                    if k.lower() not in HOP_BY_HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                ranged = self.command == "GET" and "Range" in self.headers
                if ranged and proxy.delay:
                    time.sleep(proxy.delay)
                if truncate:  # half the body, then the connection ends
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    return
                if not head:
                    self.wfile.write(data)
                if ranged:
                    with proxy._lock:
                        proxy.ranges_served += 1

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler


def ranged_get_of(key: str, offset: int):
    """A fault selector: the ranged GET of blob ``key`` that starts at ``offset``."""
    return lambda method, path, headers: (
        method == "GET" and path.split("?")[0].endswith(key)
        and (headers.get("Range") or "").startswith(f"bytes={offset}-")
    )  # fmt: skip
