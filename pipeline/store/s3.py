"""A store in S3 (``s3://BUCKET/PREFIX``) or an S3-compatible server, through botocore.

Credentials come from botocore's standard chain (environment, profile, IRSA web identity on
EKS); the endpoint from ``AWS_ENDPOINT_URL`` (read by botocore itself) unless one is passed.
Path-style addressing, which most S3-compatible servers need, is chosen by
``?addressing_style=path`` on the URL or by ``s3.addressing_style`` in the AWS config file.

Two functions own the boundary to the AWS SDK: ``make_client`` (``pipeline.store.s3_client``,
with the store URL's parsing) creates every client
(timeouts, standard retries) and ``translate_error`` (``pipeline.store.s3_errors``) turns
every SDK failure into a pipeline error, with credentials scrubbed from the message.
Clients are botocore's, as boto3 makes them; boto3 is imported only for its managed
(multipart, concurrent) uploads and downloads, so a pull, whose GETs are its own, never
loads it or s3transfer.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
)

from pipeline._files import atomic_writer
from pipeline.errors import (
    ConflictError,
    InputError,
    NotFoundError,
    StoreError,
)
from pipeline.store._redact import scrub
from pipeline.store.base import ObjectInfo, RangeSink, Store
from pipeline.store.refs import FileRef
from pipeline.store.s3_client import make_client, parse_s3_url
from pipeline.store.s3_errors import translate_error, upload_failed
from pipeline.store.s3_ranges import BotocoreOnly, RangeReader, check_content_range

MiB = 1 << 20


# Ranged GETs into a buffer take the lean path (pipeline.store.s3_ranges) unless this is
# "botocore": an escape hatch, and the baseline that bench/bench_pull.py compares against.
GETS_ENV = "INF2_PIPELINE_S3_GETS"


# S3 multipart limits (S3 user guide, "Amazon S3 multipart upload limits").
MIN_PART, MAX_PARTS = 5 * MiB, 10_000


@functools.cache
def default_transfer() -> Any:
    """boto3's ``TransferConfig`` for managed uploads and downloads (made on first use, so
    boto3 stays unloaded until then): parts of 64 MiB, few enough requests for multi-GB
    graphs, small enough to run in parallel."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB, max_concurrency=8
    )


# boto3's managed transfers over our botocore clients: the functions boto3 adds to its own
# clients as methods (boto3/s3/inject.py), called with ours.
def _upload_file(client: Any, path: str, bucket: str, key: str, config: Any) -> None:
    from boto3.s3.inject import upload_file

    upload_file(client, path, bucket, key, Config=config)


def _download_fileobj(client: Any, bucket: str, key: str, fileobj: Any, config: Any) -> None:
    from boto3.s3.inject import download_fileobj

    download_fileobj(client, bucket, key, fileobj, Config=config)


def _s3_parts_fit(ref: FileRef) -> bool:
    """Whether the ref's parts can be S3's multipart parts as they are."""
    assert ref.parts is not None and ref.part_size is not None
    return len(ref.parts) <= 1 or (ref.part_size >= MIN_PART and len(ref.parts) <= MAX_PARTS)


def _b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


ClientFactory = Callable[..., Any]


# Worker processes a pull over TLS may use (``pull_processes``): on 16 cores 16 landed
# 1.12-1.26x what 8 did, in all four pairs of two hosts; each adds its interpreter, ~30-55
# MiB (bench/RESULTS.md, thirtieth round, 2026-12-07).
MAX_PULL_PROCESSES = 16


class S3Store(Store):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        client_factory: ClientFactory = make_client,
        endpoint_url: str | None = None,
        addressing_style: str | None = None,
        transfer_config: Any = None,  # boto3's TransferConfig; None: default_transfer()
        lean_gets: bool | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._factory = client_factory
        self._client_kw = {"endpoint_url": endpoint_url, "addressing_style": addressing_style}
        self.client = client or client_factory("s3", **self._client_kw)
        self._transfer = transfer_config
        if lean_gets is None:
            lean_gets = os.environ.get(GETS_ENV, "lean") != "botocore"
        self.lean_gets = lean_gets
        # None: botocore's path (asked for, a proxy, or a client whose settings are unknown)
        self.ranges = RangeReader.for_client(self.client) if lean_gets else None

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> S3Store:
        bucket, prefix, options = parse_s3_url(url)
        kw.setdefault("addressing_style", options.get("addressing_style"))
        return cls(bucket, prefix, **kw)

    def _key(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise InputError(key, "not a valid store key", "use a relative key")
        return self.prefix + key

    def _what(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    @property
    def transfer(self) -> Any:
        return self._transfer or default_transfer()

    def _call(self, key: str, fn: Callable[[], Any], condition: str | None = None) -> Any:
        try:
            return fn()
        except Exception as e:
            if isinstance(e, ClientError | BotoCoreError) or upload_failed(e):
                raise translate_error(e, self._what(key), condition=condition) from None
            raise

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def get_bytes(self, key: str) -> bytes:
        return self._get(key)[0]

    def _get(self, key: str, **extra: Any) -> tuple[bytes, str]:
        def get() -> tuple[bytes, str]:
            r = self.client.get_object(Bucket=self.bucket, Key=self._key(key), **extra)
            return r["Body"].read(), r["ETag"]

        return self._call(key, get)

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        try:
            return self._get(key)
        except NotFoundError:
            return None

    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> None:
        extra: dict[str, str] = {}
        condition = None
        if if_match is not None:
            extra, condition = {"IfMatch": if_match}, "if_match"
        elif if_absent:
            extra, condition = {"IfNoneMatch": "*"}, "if_absent"
        try:
            self._call(
                key,
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, **extra
                ),
                condition,
            )
        except NotFoundError:
            if condition != "if_match":
                raise
            # If-Match on an absent key answers 404: for compare-and-swap that is a lost race.
            raise ConflictError(self._what(key), "was deleted since it was read", "retry") from None

    def put_file(self, key: str, path: Path, *, ref: FileRef | None = None) -> None:
        if ref is None or ref.parts is None or not _s3_parts_fit(ref):
            # Managed transfer: multipart and concurrent above the threshold; the object
            # becomes visible only when the upload completes, so readers never see part of it.
            self._call(
                key,
                lambda: _upload_file(
                    self.client, str(path), self.bucket, self._key(key), self.transfer
                ),
            )
        elif len(ref.parts) <= 1:
            with open(path, "rb") as body:
                self._call(
                    key,
                    lambda: self.client.put_object(
                        Bucket=self.bucket,
                        Key=self._key(key),
                        Body=body,
                        ChecksumSHA256=_b64(ref.sha256),
                    ),
                )
        else:
            self._call(key, lambda: self._put_parts(key, path, ref))

    def _put_parts(self, key: str, path: Path, ref: FileRef) -> None:
        """Multipart upload whose parts are the manifest's parts, each sent with its SHA-256
        from the manifest, so S3 refuses any part whose bytes changed since publish hashed
        them (S3 user guide, "Checking object integrity": x-amz-checksum-sha256 per part)."""
        full = self._key(key)
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=full, ChecksumAlgorithm="SHA256"
        )["UploadId"]
        assert ref.parts is not None
        try:
            with open(path, "rb") as f, ThreadPoolExecutor(self.transfer.max_concurrency) as pool:

                def put(i: int) -> dict[str, Any]:
                    start, length = ref.part_range(i)
                    digest = _b64(ref.parts[i])  # type: ignore[index]
                    r = self.client.upload_part(
                        Bucket=self.bucket,
                        Key=full,
                        UploadId=upload,
                        PartNumber=i + 1,
                        Body=os.pread(f.fileno(), length, start),
                        ChecksumSHA256=digest,
                    )
                    return {"PartNumber": i + 1, "ETag": r["ETag"], "ChecksumSHA256": digest}

                parts = list(pool.map(put, range(len(ref.parts))))
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(Exception):  # the failure itself is what to report
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
            raise

    def get_file(self, key: str, dest: Path) -> None:
        with atomic_writer(Path(dest)) as f:
            self._call(
                key,
                lambda: _download_fileobj(
                    self.client, self.bucket, self._key(key), f, self.transfer
                ),
            )

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            r = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )
            data = r["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""  # start at or past the end: nothing there, as with a local file
            raise translate_error(e, self._what(key)) from None
        except BotoCoreError as e:
            raise translate_error(e, self._what(key)) from None
        content_range = r.get("ContentRange")
        if content_range is None:  # a server that ignores Range sends the whole object
            return data[start : start + length]
        check_content_range(content_range, start, self._what(key))
        return data[:length]

    def read_range_into(self, key: str, start: int, buf: memoryview) -> int:
        """A ranged GET straight into ``buf`` (see pipeline.store.s3_ranges), or botocore's
        ``get_range`` copied into it where that path is off."""
        ranges = self.ranges  # read once: another thread may turn it off meanwhile
        if ranges is not None:
            try:
                return ranges.read_into(self.bucket, self._key(key), start, buf, self._what(key))
            except BotocoreOnly:  # another region, a skewed clock: botocore's path from now on
                self.ranges = None
        return super().read_range_into(key, start, buf)

    def read_range_through(
        self, key: str, start: int, length: int, chunk: memoryview, sink: RangeSink
    ) -> int:
        """One ranged GET read through ``chunk`` on the lean path; on botocore's, the
        base's one read a chunk."""
        ranges = self.ranges
        if ranges is not None:
            try:
                what = self._what(key)
                return ranges.read_through(
                    self.bucket, self._key(key), start, length, chunk, sink, what
                )
            except BotocoreOnly:  # this range a GET a chunk; the next ones read whole
                self.ranges = None
        return super().read_range_through(key, start, length, chunk, sink)

    def streams_ranges(self) -> bool:
        """Over TLS on our own reads (see ``Store.streams_ranges``). Over plain HTTP a
        read brings what has come, often far more than a MiB, and a range landed a MiB at a
        time was 1.21-1.36x slower in one process on 16 cores (bench/RESULTS.md, twenty-sixth
        round)."""
        ranges = self.ranges
        return ranges is not None and ranges.tls

    def pull_processes(self, cpus: int) -> int:
        """Over TLS on our own reads, one process per CPU, at least 2 and at most
        ``MAX_PULL_PROCESSES``: each TLS read is one 16 KiB record and takes the GIL back,
        and one process landed 0.95-1.25 GB/s on 16 cores whatever its threads, 8 processes
        3.8-6.5 GB/s and 16 4.3-7.4; on 2 CPUs two landed 1.00-1.28x one (bench/RESULTS.md,
        2026-12-07). Over plain HTTP, on botocore's path, or on one CPU, one."""
        ranges = self.ranges
        if ranges is None or not ranges.tls or cpus < 2:
            return 1
        return max(2, min(MAX_PULL_PROCESSES, cpus))

    def after_fork(self) -> None:
        """Forget the parent's connections: botocore's pool (which the manifest's GET left
        a kept-alive connection in) and the reader's. Two processes reading one inherited
        socket would each get parts of the other's replies. Closing our copy of a socket
        sends nothing while the parent holds it."""
        session = getattr(getattr(self.client, "_endpoint", None), "http_session", None)
        close = getattr(session, "close", None)
        if close is not None:
            close()
        if self.ranges is not None:
            self.ranges.forget_connections()

    def size(self, key: str) -> int | None:
        try:
            r = self._call(
                key, lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            )
        except NotFoundError:
            return None
        return int(r["ContentLength"])

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        full = self._key(prefix) if prefix else self.prefix
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=full
        )
        it = iter(pages)
        while True:
            page = self._call(prefix, lambda: next(it, None))
            if page is None:
                return
            for obj in page.get("Contents", []):
                yield ObjectInfo(
                    obj["Key"][len(self.prefix) :],
                    int(obj["Size"]),
                    obj["LastModified"].timestamp(),
                )

    def delete(self, key: str) -> None:
        self._call(key, lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)))

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            r = self._call(
                keys[i],
                lambda b=batch: self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}
                ),
            )
            if r.get("Errors"):
                first = r["Errors"][0]
                raise StoreError(
                    self._what(first["Key"][len(self.prefix) :]),
                    f"delete failed: {first.get('Code')}: {scrub(first.get('Message', ''))}",
                    "retry",
                )

    def cleanup_incomplete(self, older_than_s: float) -> int:
        """Abort multipart uploads that a killed publisher left unfinished."""
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=older_than_s)
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix
        )
        stale = [
            u
            for page in self._call("", lambda: list(pages))
            for u in page.get("Uploads", [])
            if u["Initiated"] < cutoff
        ]
        for u in stale:
            self._call(
                u["Key"],
                lambda u=u: self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]
                ),
            )
        return len(stale)

    def principal(self) -> str | None:
        """The caller's IAM ARN from STS (one short request), or None if STS does not answer."""
        try:
            sts = self._factory(
                "sts",
                connect_timeout=2,
                read_timeout=3,
                max_attempts=1,
                endpoint_url=self._client_kw["endpoint_url"],
            )
            return str(sts.get_caller_identity()["Arn"])
        except Exception:  # best effort: who promoted is informative, never required
            return None
