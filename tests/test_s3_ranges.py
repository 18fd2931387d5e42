"""``Store.read_range_into``: ranged GETs straight into a caller's buffer. On S3 it is the
lean path (pipeline.store.s3_ranges: presigned by botocore, sent with http.client on a
keep-alive connection per thread); these tests run it against moto's server, through the
fault proxy (resets, throttling, cut bodies, dropped keep-alive connections, TLS), and check
where it must step aside for botocore (a proxy, or when asked)."""

from __future__ import annotations

import os
import ssl
import threading
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from pipeline.contracts.store_layout import blob_key
from pipeline.errors import NotFoundError, StoreError
from pipeline.install.landing import with_retries
from pipeline.install.pull import pull_release
from pipeline.store import open_store
from pipeline.store.s3 import GETS_ENV, S3Store
from pipeline.store.s3_ranges import RangeReader
from tests.fault_proxy import FaultProxy
from tests.release_factory import make_release

PART = 1 << 16
DATA = os.urandom(3 * PART + 77)


def _ranged(method: str, path: str, headers) -> bool:
    return method == "GET" and "Range" in headers


def _s3(url: str, **kw) -> S3Store:
    """A store on ``url`` (an endpoint: moto's server, or the proxy in front of it)."""
    store = open_store(f"s3://{kw.pop('bucket')}/p", endpoint_url=url, **kw)
    assert isinstance(store, S3Store)
    return store


@pytest.fixture
def seeded(s3_bucket, s3_env):
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="p/r.bin", Body=DATA)
    return s3_bucket


def test_ranges_fill_the_buffer_like_get_range(store_url):
    store = open_store(store_url)
    store.put_bytes("r.bin", DATA)
    if isinstance(store, S3Store):
        assert store.ranges is not None  # the lean path, not botocore's
    buf = bytearray(PART)
    view = memoryview(buf)
    for start, n in ((0, 10), (5000, 300), (PART - 7, PART), (len(DATA) - 4, 100)):
        got = store.read_range_into("r.bin", start, view[:n])
        assert got == min(n, len(DATA) - start)
        assert buf[:got] == DATA[start : start + got] == store.get_range("r.bin", start, n)
    assert store.read_range_into("r.bin", len(DATA) + 10, view[:5]) == 0  # past the end
    assert store.read_range_into("r.bin", 3, view[:0]) == 0
    with pytest.raises(NotFoundError):
        store.read_range_into("absent.bin", 0, view[:1])


@pytest.mark.s3
def test_one_keep_alive_connection_per_thread_and_one_signature_per_key(seeded, s3_env):
    # moto's server closes every connection; the proxy in front of it keeps them open
    with FaultProxy(s3_env, lambda *_: False) as proxy:
        store = _s3(proxy.url, bucket=seeded)
        signed = []
        real = store.client.generate_presigned_url
        store.client.generate_presigned_url = lambda *a, **k: signed.append(1) or real(*a, **k)
        buf = memoryview(bytearray(PART))
        for start in range(0, len(DATA), PART):
            assert store.read_range_into("r.bin", start, buf) == min(PART, len(DATA) - start)
        assert store.ranges.connections_opened == proxy.connections == 1 and len(signed) == 1
        other = threading.Thread(target=store.read_range_into, args=("r.bin", 0, buf))
        other.start()
        other.join(60)
        assert store.ranges.connections_opened == proxy.connections == 2  # its own


@pytest.mark.s3
def test_a_dropped_keep_alive_connection_reconnects(seeded, s3_env):
    """The server closes each connection after its reply, without saying so: the next GET on
    it fails on the wire and is sent again on a new connection, invisibly."""
    with FaultProxy(s3_env, _ranged, times=None, keepalive=False, fault="none") as proxy:
        store = _s3(proxy.url, bucket=seeded)
        buf = memoryview(bytearray(PART))
        for start in (0, PART, 2 * PART):
            assert store.read_range_into("r.bin", start, buf) == PART
            assert buf == DATA[start : start + PART]
        assert store.ranges.connections_opened == proxy.connections == 3


@pytest.mark.s3
@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("reset", "cannot reach S3"),
        ("truncate", "connection closed after"),
        (503, "S3 error SlowDown"),
        (500, "S3 error InternalError"),
        (403, r"access denied \(AccessDenied"),
    ],
)
def test_faults_map_to_the_errors_botocore_s_path_gives_and_are_retried(
    seeded, s3_env, fault, message
):
    with FaultProxy(s3_env, _ranged, times=1, fault=fault) as proxy:
        store = _s3(proxy.url, bucket=seeded)
        buf = memoryview(bytearray(PART))
        with pytest.raises(StoreError, match=message) as e:
            store.read_range_into("r.bin", PART, buf)
        assert not isinstance(e.value, NotFoundError)
        # the retry that pull makes goes through, on a connection that works
        assert with_retries(lambda: store.read_range_into("r.bin", PART, buf), base=0) == PART
        assert buf == DATA[PART : 2 * PART] and len(proxy.hits) == 1


@pytest.mark.s3
def test_no_credentials_is_the_one_line_error_botocore_s_path_gives(seeded, s3_env, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    store = _s3(s3_env, bucket=seeded)
    assert store.ranges is not None
    with pytest.raises(StoreError, match="no usable AWS credentials"):
        store.read_range_into("r.bin", 0, memoryview(bytearray(10)))


@pytest.mark.s3
def test_missing_bucket_is_not_found(s3_env):
    store = _s3(s3_env, bucket="no-such-bucket-here")
    with pytest.raises(NotFoundError, match="bucket does not exist"):
        store.read_range_into("k", 0, memoryview(bytearray(10)))


@pytest.mark.s3
def test_pull_lands_every_range_through_resets_and_throttling(s3_store_url, s3_env, tmp_path):
    """The fault proxy in front of moto: the first ranged GETs are reset, throttled and cut;
    the pull retries them and installs verified bytes, one buffer per thread."""
    store = open_store(s3_store_url)
    data = os.urandom(9 * PART + 5)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=PART)
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    for i, fault in enumerate(("reset", 503, "truncate")):
        with FaultProxy(s3_env, _ranged, times=2, fault=fault) as proxy:
            s = open_store(s3_store_url, endpoint_url=proxy.url)
            # the buffers themselves, held here, so a freed one's id cannot come back
            buffers: list[bytearray] = []
            real = s.read_range_into

            def spy(k, start, buf, real=real, buffers=buffers):
                if k == key:
                    buffers.append(buf.obj)
                return real(k, start, buf)

            s.read_range_into = spy
            r = pull_release(s, "m", tmp_path / f"d{i}", version="v1", part_size=2 * PART,
                             concurrency=2)  # fmt: skip
        assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
        assert len(proxy.hits) == 2 and r.refetched_parts == 0
        assert r.parts == 5 + 1  # ranges of 2 parts, and the config file
        # 5 ranges (and their retries) landed in the two threads' buffers, not one per range
        assert len(buffers) >= 5
        assert len({id(b) for b in buffers}) <= 2


def _local_release(tmp_path: Path, data: bytes):
    """A local store holding release m v1 of one file, ``data``; and that file's blob key."""
    store = open_store(str(tmp_path / "store"))
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=PART)
    return store, blob_key(m.buckets["b1_s32"].files[0].sha256)


def _spy_reads(store, key: str, tamper) -> list[tuple[int, int, int]]:
    """Record (buffer id, start, length) of each ``read_range_into`` of ``key`` on
    ``store``, after ``tamper(start, buf, n, reads)`` has had its say over the bytes read."""
    reads: list[tuple[int, int, int]] = []
    real = store.read_range_into

    def spy(k, start, buf):
        n = real(k, start, buf)
        if k == key:
            reads.append((id(buf.obj), start, len(buf)))
            tamper(start, buf, n, reads)
        return n

    store.read_range_into = spy
    return reads


def test_land_range_reuses_the_thread_buffer_and_refetches_a_bad_part_into_it(tmp_path):
    """One thread, many ranges: one buffer; a part that arrives corrupt is fetched again,
    alone, into its place in that buffer."""
    data = os.urandom(8 * PART)
    store, key = _local_release(tmp_path, data)

    def part_flaky(start, buf, n, seen):
        if start == 2 * PART and not any(s == 3 * PART for _, s, _ in seen):
            buf[PART + 10] ^= 0xFF  # part 3 of range [2, 4) arrives wrong once

    seen = _spy_reads(store, key, part_flaky)
    r = pull_release(store, "m", tmp_path / "e", version="v1", part_size=2 * PART, concurrency=1)
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
    assert r.refetched_parts == 1
    assert (3 * PART, PART) in [(s, n) for _, s, n in seen]  # part 3 alone, again
    assert len({obj for obj, _, _ in seen}) == 1


# --- read through a small buffer (the streamed landing) ----------------------------------


def _through(store, start: int, length: int, chunk: int = 1000) -> tuple[int, list]:
    """read_range_through with a ``chunk``-byte buffer: the count, and (offset, bytes) of
    each piece as the sink got it (copied: the buffer is reused)."""
    pieces: list[tuple[int, bytes]] = []
    got = store.read_range_through(
        "r.bin", start, length, memoryview(bytearray(chunk)),
        lambda piece, off: pieces.append((off, bytes(piece))),
    )  # fmt: skip
    return got, pieces


def test_a_range_read_through_a_small_buffer_comes_in_order_piece_by_piece(store_url):
    store = open_store(store_url)
    store.put_bytes("r.bin", DATA)
    for start, n in ((0, 10), (5000, 2500), (PART - 7, PART), (len(DATA) - 1500, 4000)):
        got, pieces = _through(store, start, n)
        assert got == min(n, len(DATA) - start)
        assert [off for off, _ in pieces] == list(range(start, start + got, 1000))
        assert all(len(b) == 1000 for _, b in pieces[:-1])
        assert b"".join(b for _, b in pieces) == DATA[start : start + got]
    assert _through(store, len(DATA) + 10, 5) == (0, [])  # past the end
    assert _through(store, 3, 0) == (0, [])


@pytest.mark.s3
def test_a_range_read_through_is_one_get_on_one_kept_alive_connection(seeded, s3_env):
    with FaultProxy(s3_env, _ranged, times=None, fault="none") as proxy:
        store = _s3(proxy.url, bucket=seeded)
        for start in (0, PART, 2 * PART):
            got, pieces = _through(store, start, PART, chunk=4096)
            assert got == PART and b"".join(b for _, b in pieces) == DATA[start : start + PART]
        assert len(proxy.hits) == 3 and store.ranges.connections_opened == proxy.connections == 1


@pytest.mark.s3
@pytest.mark.parametrize("tls", [False, True])
def test_a_sink_that_fails_mid_body_drops_its_connection(seeded, s3_env, self_signed, tls,
                                                          monkeypatch):  # fmt: skip
    """The sink's own error (a full disk, say) comes out as itself, and the connection with
    the rest of that body on it is not reused: the next read gets its own bytes."""
    if tls:
        monkeypatch.setenv("AWS_CA_BUNDLE", self_signed[0])
    with FaultProxy(s3_env, lambda *_: False, tls=self_signed if tls else None) as proxy:
        store = _s3(proxy.url, bucket=seeded)

        def full(piece, off):
            if off > PART:
                raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space left"):
            store.read_range_through("r.bin", PART, 2 * PART, memoryview(bytearray(4096)), full)
        buf = bytearray(PART)
        assert store.read_range_into("r.bin", 0, memoryview(buf)) == PART
        assert buf == DATA[:PART]
        assert store.ranges.connections_opened == proxy.connections == 2
        assert store.streams_ranges() is tls  # a TLS record a read: the landing streams


@pytest.mark.s3
def test_a_body_cut_short_while_read_through_is_a_retried_store_error(seeded, s3_env):
    with FaultProxy(s3_env, _ranged, times=1, fault="truncate") as proxy:
        store = _s3(proxy.url, bucket=seeded)
        with pytest.raises(StoreError, match="connection closed after"):
            _through(store, 0, 2 * PART)
        got, pieces = with_retries(lambda: _through(store, 0, 2 * PART), base=0)
        assert got == 2 * PART and b"".join(b for _, b in pieces) == DATA[: 2 * PART]


@pytest.mark.s3
def test_a_pull_over_tls_streams_each_range_and_refetches_a_bad_part_alone(
    s3_store_url, s3_env, self_signed, tmp_path, monkeypatch
):
    """Over https the landing streams (a MiB at a time, each piece written and hashed as it
    comes): every byte installed, one corrupted part fetched again alone, the rest once."""
    monkeypatch.setenv("AWS_CA_BUNDLE", self_signed[0])
    store = open_store(s3_store_url)
    data = os.urandom(9 * PART + 5)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=PART)
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    with FaultProxy(s3_env, lambda _m, path, h: key in path and "Range" in h,
                    tls=self_signed) as proxy:  # fmt: skip
        s = open_store(s3_store_url, endpoint_url=proxy.url)
        assert s.streams_ranges()
        streamed, whole = [], []
        into, through = s.read_range_into, s.read_range_through
        s.read_range_into = lambda k, start, buf: (
            whole.append((k, start, len(buf))) or into(k, start, buf)
        )
        s.read_range_through = lambda k, *a: streamed.append(k) or through(k, *a)
        r = pull_release(s, "m", tmp_path / "d", version="v1", part_size=2 * PART,
                         concurrency=2, processes=1)  # fmt: skip
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
    assert streamed.count(key) == 5 and r.parts == 5 + 1
    # the corrupted part (the middle of the first range's body), and only it, fetched again
    [(_, _, first)] = proxy.hits
    a, b = (int(x) for x in first.removeprefix("bytes=").split("-"))
    bad = (a + (min(b, len(data) - 1) - a + 1) // 2) // PART
    assert [(k, start, n) for k, start, n in whole if k == key] == [(key, bad * PART, PART)]
    assert r.refetched_parts == 1


def test_a_streamed_range_lands_piece_by_piece_and_a_bad_part_is_refetched_alone(
    tmp_path, monkeypatch
):
    """A store whose reads are TLS records streams (here a local store made to): the range
    comes through one small buffer in pieces that straddle parts, each written as it comes;
    a piece that arrives corrupt fails only its part, which is fetched again alone."""
    import pipeline.install.landing as landing
    from pipeline.store.local import LocalStore

    monkeypatch.setattr(landing, "STREAM_CHUNK", 10_000)  # not a divisor of a part
    monkeypatch.setattr(LocalStore, "streams_ranges", lambda self: True)
    data = os.urandom(8 * PART + 3)
    store, key = _local_release(tmp_path, data)

    def flaky(start, buf, n, _reads):
        if start <= 5 * PART + 7 < start + n and len(buf) < PART:  # once, while streamed
            buf[5 * PART + 7 - start] ^= 0xFF

    reads = _spy_reads(store, key, flaky)
    r = pull_release(store, "m", tmp_path / "e", version="v1", part_size=4 * PART, concurrency=1)
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
    assert r.refetched_parts == 1 and r.parts == 3 + 1
    streamed = [(obj, s, n) for obj, s, n in reads if n <= 10_000]
    assert len({obj for obj, _, _ in streamed}) == 1  # one small buffer for every piece
    assert sum(n for _, _, n in streamed) == len(data)
    assert [(s, n) for _, s, n in reads if n > 10_000] == [(5 * PART, PART)]  # part 5, again


@pytest.mark.s3
def test_a_streamed_range_cut_short_is_fetched_again_whole_and_checked_afresh(
    s3_store_url, s3_env, self_signed, tmp_path, monkeypatch
):
    """A streamed range whose body is cut midway is retried from its start, its parts'
    hashes begun again: no part counts as bad, and every byte installed is right."""
    monkeypatch.setenv("AWS_CA_BUNDLE", self_signed[0])
    data = os.urandom(9 * PART + 5)
    m = make_release(open_store(s3_store_url), tmp_path, buckets={"b1_s32": {"w.bin": data}},
                     part_size=PART)  # fmt: skip
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    cut = lambda _m, path, h: key in path and h.get("Range", "").startswith("bytes=0-")  # noqa: E731
    with FaultProxy(s3_env, cut, times=1, fault="truncate", tls=self_signed) as proxy:
        s = open_store(s3_store_url, endpoint_url=proxy.url)
        assert s.streams_ranges()
        r = pull_release(s, "m", tmp_path / "d", version="v1", part_size=4 * PART,
                         concurrency=2, processes=1)  # fmt: skip
    assert len(proxy.hits) == 1  # the first range's GET was cut in half
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
    assert r.refetched_parts == 0 and r.parts == 3 + 1


# --- TLS -------------------------------------------------------------------------------


@pytest.mark.s3
def test_https_verifies_the_certificate_with_the_client_s_ca_bundle(
    seeded, s3_env, self_signed, monkeypatch
):
    with FaultProxy(s3_env, lambda *_: False, tls=self_signed) as proxy:
        # No CA bundle that knows the certificate: refused, as botocore would.
        store = _s3(proxy.url, bucket=seeded)
        assert store.ranges.ssl_context.verify_mode == ssl.CERT_REQUIRED
        with pytest.raises(StoreError, match="CERTIFICATE_VERIFY_FAILED"):
            store.read_range_into("r.bin", 0, memoryview(bytearray(10)))
        # AWS_CA_BUNDLE (boto3's setting) names it: verified and read.
        monkeypatch.setenv("AWS_CA_BUNDLE", self_signed[0])
        store = _s3(proxy.url, bucket=seeded)
        buf = bytearray(PART)
        assert store.read_range_into("r.bin", PART, memoryview(buf)) == PART
        assert buf == DATA[PART : 2 * PART]
        assert store.get_range("r.bin", 0, 5) == DATA[:5]  # botocore agrees
    monkeypatch.delenv("AWS_CA_BUNDLE")
    # verify=False on the client: not verified (botocore's --no-verify-ssl)
    client = boto3.client("s3", endpoint_url=proxy.url, verify=False)
    reader = RangeReader.for_client(client)
    assert reader is not None and reader.ssl_context.verify_mode == ssl.CERT_NONE


# --- where botocore's path stays ---------------------------------------------------------


@pytest.mark.s3
def test_a_proxy_in_the_environment_keeps_botocore_s_path(seeded, s3_env, monkeypatch):
    with FaultProxy(s3_env, _ranged, times=None, fault="none") as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        store = _s3(s3_env, bucket=seeded)
        assert store.ranges is None
        buf = bytearray(PART)
        assert store.read_range_into("r.bin", PART, memoryview(buf)) == PART
        assert buf == DATA[PART : 2 * PART]
        assert len(proxy.hits) == 1  # the ranged GET went through the proxy
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # not for this endpoint: the lean path
    assert _s3(s3_env, bucket=seeded).ranges is not None


def test_proxies_in_the_client_config_or_the_env_switch_keep_botocore_s_path(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    proxied = boto3.client(
        "s3",
        region_name="us-east-1",
        endpoint_url="http://127.0.0.1:9",
        config=Config(proxies={"http": "http://127.0.0.1:8"}),
    )
    assert RangeReader.for_client(proxied) is None
    plain = boto3.client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9")
    assert RangeReader.for_client(plain) is not None
    assert RangeReader.for_client(object()) is None  # not a botocore client: no guessing
    store = S3Store("b", client=plain)
    assert store.ranges is not None
    monkeypatch.setenv(GETS_ENV, "botocore")
    off = S3Store("b", client=plain)
    assert off.ranges is None and off.lean_gets is False
    assert S3Store("b", lean_gets=True, client=plain).ranges is not None  # asked for: on


@pytest.mark.s3
def test_a_region_redirect_hands_the_store_to_botocore_s_path(seeded, s3_env):
    """A bucket in another region than the client's: botocore re-signs for the right one, a
    presigned URL cannot. The read goes through botocore's path, and so do later ones."""
    with FaultProxy(s3_env, _ranged, times=1, fault=301) as proxy:
        store = _s3(proxy.url, bucket=seeded)
        buf = bytearray(PART)
        assert store.read_range_into("r.bin", PART, memoryview(buf)) == PART
        assert buf == DATA[PART : 2 * PART] and len(proxy.hits) == 1
        assert store.ranges is None


@pytest.mark.s3
def test_presigned_urls_are_sigv4(seeded, s3_env):
    store = _s3(s3_env, bucket=seeded)
    url = store.ranges._url(store.bucket, "p/r.bin")
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in url and "X-Amz-Signature=" in url


def test_local_store_reads_straight_into_the_buffer(tmp_path):
    store = open_store(str(tmp_path))
    store.put_bytes("a/b.bin", DATA)
    buf = bytearray(len(DATA) + 10)
    assert store.read_range_into("a/b.bin", 0, memoryview(buf)) == len(DATA)
    assert bytes(buf[: len(DATA)]) == DATA
    assert Path(tmp_path / "a/b.bin").stat().st_size == len(DATA)
