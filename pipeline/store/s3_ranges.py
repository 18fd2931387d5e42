"""Ranged GETs from S3 straight into a caller's buffer: the bytes path of ``pull``.

botocore reads a body through urllib3 in 128 KiB reads, each a new bytes object joined at
the end, with the GIL held between them; at several GB/s that costs more CPU than checking
the bytes. Here botocore only signs: a presigned GET URL (made locally, from the client's
credential chain, endpoint, region and addressing style). The request goes out with the
standard library's ``http.client`` on a keep-alive connection owned by the calling thread,
with ``Range`` as a plain header (a presigned URL signs only ``host``), and a 206 body is
read by the socket's own ``recv_into`` into the caller's buffer (``_read_direct``): socket
reads that release the GIL and make no intermediate objects. ``read_through`` reads a range
through a small buffer instead, handing each piece on as it fills (the landing then hashes
and writes it while it is in the CPU's cache).

Settings come from the client's own HTTP session (TLS verification and CA bundle, client
certificate, proxies) and config (timeouts). Where they cannot be read, or where botocore
would go through a proxy, ``RangeReader.for_client`` returns None and the store keeps
botocore's path: tunnelling through a proxy (CONNECT, proxy auth, proxy TLS settings) is
what urllib3 already does well, and through a proxy that hop, not the parsing, is the limit.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit
from xml.etree import ElementTree

from botocore.exceptions import BotoCoreError, ClientError

from pipeline.errors import PipelineError, StoreError
from pipeline.store._redact import scrub
from pipeline.store.base import RangeSink
from pipeline.store.s3_errors import translate_error

# A presigned URL is reused for this long per key (a blob's ranges share one signature),
# and valid for URL_EXPIRES_S. botocore refreshes temporary credentials at least 10 minutes
# before they expire, so a URL at most a minute old never outlives its credentials.
URL_REUSE_S, URL_EXPIRES_S = 60.0, 900
MAX_ERROR_BODY = 1 << 16  # S3 error documents are small; read no more of an odd reply
# A connection the server dropped (http.client's RemoteDisconnected is a ConnectionResetError)
_DROPPED = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)
# Replies that botocore handles and a presigned URL cannot: the bucket is in another region
# than the client was made for (botocore's S3RegionRedirector re-signs for the right one),
# or this host's clock is off (botocore corrects its signing time).
BOTOCORE_ONLY = {
    "PermanentRedirect",
    "TemporaryRedirect",
    "AuthorizationHeaderMalformed",
    "AuthorizationQueryParametersError",
    "IllegalLocationConstraintException",
    "RequestTimeTooSkewed",
}


class BotocoreOnly(StoreError):
    """A reply that only botocore's own path handles (see ``BOTOCORE_ONLY``)."""


class RangeReader:
    """Ranged GETs for one botocore S3 client; thread-safe (one connection per thread)."""

    def __init__(
        self,
        client: Any,
        *,
        ssl_context: ssl.SSLContext | None,
        connect_timeout: float,
        read_timeout: float,
        tls: bool = False,
    ) -> None:
        self.client = client
        self.ssl_context = ssl_context
        self.tls = tls  # the endpoint is https: every read is one TLS record
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._urls: dict[tuple[str, str], tuple[str, float]] = {}
        self._urls_lock = threading.Lock()
        self._local = threading.local()
        self.connections_opened = 0  # for tests and benchmarks: keep-alive keeps this low

    @classmethod
    def for_client(cls, client: Any) -> RangeReader | None:
        """A reader with the client's TLS, timeout and proxy settings, or None where
        botocore's own path must stay: a proxy applies, a client certificate is set, or the
        client is not a botocore client whose HTTP settings can be read."""
        http_session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        meta = getattr(client, "meta", None)
        needed = ("_verify", "_proxy_config", "_cert_file")  # botocore's URLLib3Session
        if meta is None or not all(hasattr(http_session, a) for a in needed):
            return None
        endpoint = str(getattr(meta, "endpoint_url", "") or "")
        if urlsplit(endpoint).scheme not in ("http", "https"):
            return None
        if http_session._proxy_config.proxy_url_for(endpoint) or http_session._cert_file:
            return None  # botocore tunnels through the proxy (see the module docstring)
        config = meta.config
        return cls(
            client,
            ssl_context=_ssl_context(http_session._verify),
            connect_timeout=float(config.connect_timeout or 60),
            read_timeout=float(config.read_timeout or 60),
            tls=urlsplit(endpoint).scheme == "https",
        )

    def read_into(self, bucket: str, key: str, start: int, buf: memoryview, what: str) -> int:
        """Read ``len(buf)`` bytes of ``s3://bucket/key`` from ``start`` into ``buf``; the
        count read, fewer where the object ends sooner (0 at or past its end). Errors are
        the ones ``translate_error`` gives for botocore's; a dropped connection reconnects."""
        return self._get(bucket, key, start, len(buf), buf, None, what)

    def read_through(
        self,
        bucket: str,
        key: str,
        start: int,
        length: int,
        chunk: memoryview,
        sink: RangeSink,
        what: str,
    ) -> int:
        """One ranged GET of ``length`` bytes read through ``chunk``, each piece handed to
        ``sink`` as it fills (``Store.read_range_through``); otherwise as ``read_into``."""
        if not len(chunk):
            raise ValueError("read_through needs a chunk of at least one byte")
        return self._get(bucket, key, start, length, chunk, sink, what)

    def _get(
        self,
        bucket: str,
        key: str,
        start: int,
        length: int,
        buf: memoryview,
        sink: RangeSink | None,
        what: str,
    ) -> int:
        if not length:
            return 0
        try:
            url = self._url(bucket, key)
        except (BotoCoreError, ClientError) as e:  # no usable credentials, say
            raise translate_error(e, what) from None
        parts = urlsplit(url)
        target = f"{parts.path or '/'}?{parts.query}"
        headers = {"Range": f"bytes={start}-{start + length - 1}"}
        conn_key = (parts.scheme, parts.netloc)
        for attempt in range(2):
            conn, reused = self._connection(conn_key, what)
            try:
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
            except _DROPPED as e:
                self._drop(conn_key)
                if reused and attempt == 0:
                    continue  # the server closed an idle keep-alive connection: once more, anew
                raise _unreachable(what, e) from None
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn_key)
                raise _unreachable(what, e) from None
            complete = False  # whether the reply was read to its end (an error's too)
            try:
                got, complete = self._body(conn, resp, start, length, buf, sink, what, bucket, key)
                return got
            except BaseException:  # a sink's own error too: the rest of the body is unread
                complete = resp.isclosed() and not resp.length
                raise
            finally:  # reused only when the reply was read whole and the server keeps it open
                if resp.will_close or not complete:
                    self._drop(conn_key)
        raise AssertionError("unreachable")

    def _body(
        self,
        conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse,
        start: int,
        length: int,
        buf: memoryview,
        sink: RangeSink | None,
        what: str,
        bucket: str,
        key: str,
    ) -> tuple[int, bool]:
        """The reply's body, ``length`` bytes asked for, read into ``buf`` (or through it to
        ``sink``): the count read, and whether the reply was read to its end (its connection
        can serve the next request)."""
        status = resp.status
        if status == 416:  # InvalidRange: at or past the end, nothing there
            resp.read(MAX_ERROR_BODY)
            return 0, resp.isclosed()
        if status not in (200, 206):
            if status == 403:  # maybe an expired signature: the next attempt signs anew
                with self._urls_lock:
                    self._urls.pop((bucket, key), None)
            code, error = _error(status, resp.read(MAX_ERROR_BODY), what)
            if code in BOTOCORE_ONLY or status in (301, 307):
                raise BotocoreOnly(what, f"S3 answered {status} {code}", None)
            raise error
        if status == 206:
            check_content_range(resp.getheader("Content-Range") or "", start, what)
            body, sock = resp.length, conn.sock
            if body is not None and not resp.chunked and sock is not None:
                want = min(body, length)
                return _read_direct(resp, sock, buf, want, body, sink, start, what)
        skip = start if status == 200 else 0  # 200: the whole object (a server without ranges)
        try:
            while skip:
                n = resp.readinto(buf[: min(skip, len(buf))])
                if not n:
                    return 0, False
                skip -= n
        except (OSError, http.client.HTTPException) as e:
            raise _unreachable(what, e) from None
        got = _receive(resp.readinto, buf, length, sink, start, what)
        if resp.length and got < length:  # the connection ended before Content-Length did
            raise StoreError(what, f"connection closed after {got} bytes of a range", "retry")
        # the rest of a longer body (a 200) is dropped with the connection
        return got, resp.isclosed() and not resp.length

    def _url(self, bucket: str, key: str) -> str:
        now = time.monotonic()
        with self._urls_lock:
            hit = self._urls.get((bucket, key))
            if hit is not None and now - hit[1] < URL_REUSE_S:
                return hit[0]
        url = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=URL_EXPIRES_S
        )
        with self._urls_lock:
            if len(self._urls) > 4096:
                self._urls.clear()
            self._urls[(bucket, key)] = (url, now)
        return str(url)

    def _connection(
        self, conn_key: tuple[str, str], what: str
    ) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the endpoint, and whether it served a request before."""
        conns: dict = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(conn_key)
        if conn is not None:
            return conn, True
        scheme, netloc = conn_key
        if scheme == "https":
            conn = http.client.HTTPSConnection(
                netloc, timeout=self.connect_timeout, context=self.ssl_context
            )
        else:
            conn = http.client.HTTPConnection(netloc, timeout=self.connect_timeout)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise _unreachable(what, e) from None
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout)
        conns[conn_key] = conn
        self.connections_opened += 1
        return conn, False

    def _drop(self, conn_key: tuple[str, str]) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(conn_key, None)
        if conn is not None:
            conn.close()

    def forget_connections(self) -> None:
        """After a fork: every thread's connections are the parent's; start afresh."""
        self._local = threading.local()

    def close_thread_connections(self) -> None:
        """Close this thread's connections (they are closed anyway when the thread ends)."""
        for conn in self._local.__dict__.pop("conns", {}).values():
            conn.close()


def _read_direct(
    resp: http.client.HTTPResponse,
    sock: Any,
    buf: memoryview,
    want: int,
    length: int,
    sink: RangeSink | None,
    start: int,
    what: str,
) -> tuple[int, bool]:
    """``want`` bytes of a 206 body of ``length`` read by the socket's own ``recv_into``
    into ``buf`` (or through it to ``sink``), past http.client's ``BufferedReader`` and
    ``SocketIO``: over TLS each read is one 16 KiB record, and those two layers were two
    Python calls a record with the GIL held (~1.7 µs a record, 0.08-0.36 CPU-s/GB on the
    2-core VM; bench/RESULTS.md, 2026-12-07). First the body's bytes that the header reads
    left buffered (``read1`` takes only those, or makes one read), then the response is
    closed (its buffered file, not the socket, so the keep-alive connection serves the
    next request) and the rest comes from the socket, straight into ``buf``."""
    try:
        # peek: what is buffered, or one read of the buffer's size (read1 alone, with nothing
        # buffered, would allocate a bytes object of the whole range for one record)
        head = resp.fp.read1(min(len(resp.fp.peek(1)), want)) if want else b""
        resp.close()  # what it still buffered is lost: all of it had to be taken
    except (OSError, http.client.HTTPException) as e:
        raise _unreachable(what, e) from None
    if sink is None:  # buf holds the body: the rest goes after the head
        buf[: len(head)] = head
        buf = buf[len(head) :]
    elif head:  # the head may be longer than buf: handed on as it is
        sink(memoryview(head), start)
    rest, at = want - len(head), start + len(head)
    got = len(head) + _receive(sock.recv_into, buf, rest, sink, at, what)
    if got < want:  # the connection ended before Content-Length did
        raise StoreError(what, f"connection closed after {got} bytes of a range", "retry")
    return got, got == length


def _receive(
    read: Callable[[memoryview], int],
    buf: memoryview,
    want: int,
    sink: RangeSink | None,
    start: int,
    what: str,
) -> int:
    """``want`` bytes of a body by ``read`` (a ``readinto``): into ``buf``, which holds
    them; or, with ``sink``, through ``buf`` a piece at a time, each handed on with its
    offset in the object (from ``start``) before the next read. The count that came,
    fewer where the body ended sooner."""
    got = have = 0
    while True:
        room = want - got if sink is None else min(len(buf), want - got)
        try:
            while have < room and (n := read(buf[have:room])):
                have += n
        except (OSError, http.client.HTTPException) as e:
            raise _unreachable(what, e) from None
        if sink is None:
            return have
        if have:  # the sink's own errors are its own, not the network's
            sink(buf[:have], start + got)
        got += have
        if have < room or got == want:
            return got
        have = 0


def check_content_range(content_range: str, start: int, what: str) -> None:
    """A 206 reply's ``Content-Range`` must start where the request asked."""
    first = content_range.removeprefix("bytes ").split("-")[0]
    if first != str(start):
        raise StoreError(what, f"asked for bytes from {start}, got {first or '?'}", "retry")


def _ssl_context(verify: Any) -> ssl.SSLContext:
    """TLS as botocore would do it: ``verify`` False skips verification; True uses
    botocore's CA bundle (certifi's where installed); a path is a CA bundle (or directory)."""
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    from botocore.httpsession import get_cert_path

    path = get_cert_path(verify)
    if os.path.isdir(path):
        return ssl.create_default_context(capath=path)
    return ssl.create_default_context(cafile=path)


def _unreachable(what: str, e: BaseException) -> StoreError:
    return StoreError(
        what,
        f"cannot reach S3: {scrub(str(e)) or type(e).__name__}",
        "check the network and AWS_ENDPOINT_URL",
    )


def _error(status: int, body: bytes, what: str) -> tuple[str, PipelineError]:
    """The reply's S3 error code, and the pipeline error that botocore's ClientError for
    this reply would become."""
    code, message = "", ""
    with contextlib.suppress(ElementTree.ParseError, ValueError):
        root = ElementTree.fromstring(body) if body.strip() else None
        if root is not None:
            code = root.findtext("Code") or ""
            message = root.findtext("Message") or ""
    error = ClientError(
        {
            "Error": {"Code": code or str(status), "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        "GetObject",
    )
    return code, translate_error(error, what)
