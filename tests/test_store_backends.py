"""The Store contract, identical on a local directory and on S3 (moto's server over HTTP)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from pipeline.errors import (
    AlreadyExistsError,
    ConflictError,
    InputError,
    NotFoundError,
    StoreError,
)
from pipeline.store import REGISTRY, open_store
from pipeline.store.local import LocalStore
from pipeline.store.s3 import S3Store
from pipeline.store.s3_client import make_client, parse_s3_url
from pipeline.store.s3_errors import translate_error
from tests.conftest import FAKE_AWS_ACCESS_KEY_ID
from tests.store_helpers import race


def test_bytes_roundtrip_size_exists_and_delete(store_url):
    s = open_store(store_url)
    assert not s.exists("a/b.json") and s.size("a/b.json") is None
    s.put_bytes("a/b.json", b"hello")
    assert s.exists("a/b.json") and s.size("a/b.json") == 5
    assert s.get_bytes("a/b.json") == b"hello"
    s.put_bytes("a/b.json", b"bye")  # unconditional writes replace
    assert s.get_bytes("a/b.json") == b"bye"
    s.delete("a/b.json")
    s.delete("a/b.json")  # absent is fine
    with pytest.raises(NotFoundError, match="not found in the store"):
        s.get_bytes("a/b.json")


def test_conditional_create_refuses_an_existing_key(store_url):
    s = open_store(store_url)
    s.put_bytes("m.json", b"first", if_absent=True)
    with pytest.raises(AlreadyExistsError):
        s.put_bytes("m.json", b"second", if_absent=True)
    assert s.get_bytes("m.json") == b"first"


def test_compare_and_swap_succeeds_on_the_read_tag_and_fails_on_a_stale_one(store_url):
    s = open_store(store_url)
    assert s.get_versioned("c.json") is None
    s.put_bytes("c.json", b"v1", if_absent=True)
    data, tag1 = s.get_versioned("c.json")
    assert data == b"v1"
    s.put_bytes("c.json", b"v2", if_match=tag1)
    data, tag2 = s.get_versioned("c.json")
    assert data == b"v2" and tag2 != tag1
    with pytest.raises(ConflictError):
        s.put_bytes("c.json", b"v3", if_match=tag1)  # someone moved it since tag1
    assert s.get_bytes("c.json") == b"v2"
    s.delete("c.json")
    with pytest.raises(ConflictError):
        s.put_bytes("c.json", b"v4", if_match=tag2)  # deleted since read


def test_racing_conditional_creates_have_exactly_one_winner(store_url):
    """Eight writers, one key, released together: exactly one create succeeds."""
    stores = [open_store(store_url) for _ in range(8)]
    for round_ in range(5):
        key = f"race/{round_}.json"
        results, errors = race(
            8, lambda i, key=key: stores[i].put_bytes(key, b"writer %d" % i * 1000, if_absent=True)
        )
        assert len(results) == 1, errors
        assert len(errors) == 7 and all(isinstance(e, AlreadyExistsError) for e in errors.values())
        (winner,) = results
        assert stores[0].get_bytes(key) == b"writer %d" % winner * 1000


def test_files_roundtrip_through_temporary_names(store_url, tmp_path):
    s = open_store(store_url)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    s.put_file("blobs/x", src)
    dest = tmp_path / "out" / "x.bin"
    s.get_file("blobs/x", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert not list(dest.parent.glob("*.incomplete"))
    with pytest.raises(NotFoundError):
        s.get_file("blobs/absent", tmp_path / "out" / "absent")
    assert not (tmp_path / "out" / "absent").exists()
    assert not list(dest.parent.glob("*.incomplete"))


def test_ranged_reads(store_url):
    s = open_store(store_url)
    data = bytes(range(256)) * 40
    s.put_bytes("r.bin", data)
    assert s.get_range("r.bin", 0, 10) == data[:10]
    assert s.get_range("r.bin", 5000, 300) == data[5000:5300]
    assert s.get_range("r.bin", len(data) - 4, 100) == data[-4:]  # short at the end
    assert s.get_range("r.bin", len(data) + 10, 5) == b""  # past the end
    assert s.get_range("r.bin", 3, 0) == b""
    with pytest.raises(NotFoundError):
        s.get_range("absent.bin", 0, 1)


def test_listing_with_sizes_and_times_and_batch_delete(store_url):
    s = open_store(store_url)
    before = time.time() - 5
    for k in ("blobs/sha256/a", "blobs/sha256/b", "models/m/releases/v1.json", "cache/k.json"):
        s.put_bytes(k, k.encode())
    assert sorted(s.list("blobs/sha256/")) == ["blobs/sha256/a", "blobs/sha256/b"]
    infos = {i.key: i for i in s.list_info("")}
    assert set(infos) == {
        "blobs/sha256/a",
        "blobs/sha256/b",
        "models/m/releases/v1.json",
        "cache/k.json",
    }
    assert infos["cache/k.json"].size == len(b"cache/k.json")
    assert all(before < i.mtime < time.time() + 5 for i in infos.values())
    assert list(s.list("nothing/here/")) == []
    s.delete_many(["blobs/sha256/a", "cache/k.json", "absent"])
    assert sorted(s.list("")) == ["blobs/sha256/b", "models/m/releases/v1.json"]


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b"])
def test_keys_cannot_escape_the_store(store_url, key):
    with pytest.raises(InputError):
        open_store(store_url).put_bytes(key, b"x")


def test_unknown_scheme_lists_the_registry():
    with pytest.raises(InputError) as e:
        open_store("gs://bucket/x")
    assert "s3://" in e.value.hint and "file://" in e.value.hint
    assert set(REGISTRY) == {"file", "s3"}


def test_local_store_accepts_paths_and_file_urls(tmp_path):
    a = open_store(str(tmp_path / "s"))
    b = open_store(f"file://{tmp_path / 's'}")
    assert isinstance(a, LocalStore) and a.root == b.root


def test_local_partial_files_are_invisible_and_collected(tmp_path):
    s = LocalStore(tmp_path / "s")
    s.put_bytes("blobs/sha256/a", b"x")
    leftover = tmp_path / "s" / "blobs" / "sha256" / ".b.123.incomplete"
    leftover.write_bytes(b"half")
    assert list(s.list("blobs/")) == ["blobs/sha256/a"]
    assert s.cleanup_incomplete(3600) == 0  # young: may belong to a live upload
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))
    assert s.cleanup_incomplete(3600) == 1 and not leftover.exists()


def test_local_compare_and_swap_survives_a_writer_killed_holding_the_lock(tmp_path):
    """The lock is an flock: the kernel releases it with the dead process."""
    s = LocalStore(tmp_path / "s")
    s.put_bytes("c.json", b"v1", if_absent=True)
    lock = tmp_path / "s" / "c.json.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait()
    _, tag = s.get_versioned("c.json")
    s.put_bytes("c.json", b"v2", if_match=tag)
    assert s.get_bytes("c.json") == b"v2"


# --- S3 specifics ----------------------------------------------------------------------------


def test_s3_url_parsing():
    assert parse_s3_url("s3://bkt/some/prefix/") == ("bkt", "some/prefix/", {})
    assert parse_s3_url("s3://bkt") == ("bkt", "", {})
    assert parse_s3_url("s3://bkt/p?addressing_style=path")[2] == {"addressing_style": "path"}
    with pytest.raises(InputError):
        parse_s3_url("s3://bkt/p?addressing_style=sideways")
    with pytest.raises(InputError):
        parse_s3_url("s3://bkt/p?region=x")


def test_one_client_factory_sets_timeouts_and_standard_retries(s3_env):
    client = make_client(addressing_style="path", connect_timeout=3, read_timeout=7)
    cfg = client.meta.config
    assert (cfg.connect_timeout, cfg.read_timeout) == (3, 7)
    assert cfg.retries["mode"] == "standard"
    assert cfg.s3["addressing_style"] == "path"
    assert client.meta.endpoint_url == s3_env  # AWS_ENDPOINT_URL, read by boto3 itself


@pytest.mark.s3
def test_s3_store_uses_an_injected_client_factory(s3_bucket, s3_env):
    made = []

    def factory(service, **kw):
        made.append((service, kw))
        return make_client(service, **kw)

    s = S3Store.from_url(
        f"s3://{s3_bucket}/p?addressing_style=path", client_factory=factory, endpoint_url=s3_env
    )
    s.put_bytes("k", b"v")
    assert s.get_bytes("k") == b"v"
    assert made == [("s3", {"endpoint_url": s3_env, "addressing_style": "path"})]


@pytest.mark.s3
def test_s3_large_files_go_multipart_and_arrive_whole(s3_bucket, s3_env, tmp_path):
    small_parts = TransferConfig(
        multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=4
    )
    s = S3Store(s3_bucket, "p", transfer_config=small_parts)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 << 20))
    s.put_file("blobs/big", src)
    head = boto3.client("s3").head_object(Bucket=s3_bucket, Key="p/blobs/big")
    assert head["ETag"].strip('"').endswith("-3")  # three parts of ≤ 5 MiB
    out = tmp_path / "back.bin"
    s.get_file("blobs/big", out)
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()


@pytest.mark.s3
def test_s3_abandoned_multipart_uploads_are_aborted(s3_bucket, s3_env):
    s = S3Store(s3_bucket, "p")
    client = boto3.client("s3")
    client.create_multipart_upload(Bucket=s3_bucket, Key="p/blobs/sha256/half")
    client.create_multipart_upload(Bucket=s3_bucket, Key="elsewhere/x")  # not under our prefix
    # moto reports every upload as initiated on 2010-11-10, so the age cut-off (tested on
    # the local store) cannot be exercised here; an old upload is aborted.
    assert s.cleanup_incomplete(3600) == 1
    assert [u["Key"] for u in client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]] == [
        "elsewhere/x"
    ]


@pytest.mark.s3
def test_s3_missing_bucket_and_unreachable_endpoint_are_clear(s3_env):
    s = open_store("s3://no-such-bucket-here/p")
    with pytest.raises(NotFoundError, match="bucket does not exist"):
        s.put_bytes("k", b"v")
    dead = S3Store(
        "b",
        "p",
        client=make_client(endpoint_url="http://127.0.0.1:9", connect_timeout=1, max_attempts=1),
    )
    with pytest.raises(StoreError, match="cannot reach S3") as e:
        dead.get_bytes("k")
    assert e.value.exit_code == 1 and "AWS_ENDPOINT_URL" in e.value.hint


@pytest.mark.s3
def test_s3_path_style_addressing_works_against_the_endpoint(s3_bucket, s3_env):
    s = open_store(f"s3://{s3_bucket}/ps?addressing_style=path")
    s.put_bytes("k", b"v")
    assert boto3.client("s3").get_object(Bucket=s3_bucket, Key="ps/k")["Body"].read() == b"v"


def test_error_translation_never_shows_credentials():
    err = ClientError(
        {
            "Error": {
                "Code": "SignatureDoesNotMatch",
                "Message": f"bad signature for {FAKE_AWS_ACCESS_KEY_ID}: Signature=abc123, "
                "X-Amz-Credential=AKIAOTHERFAKEKEY0000/20250101",
                "AWSAccessKeyId": FAKE_AWS_ACCESS_KEY_ID,
            },
            "ResponseMetadata": {"HTTPStatusCode": 403},
        },
        "PutObject",
    )
    e = translate_error(err, "s3://b/k")
    assert isinstance(e, StoreError) and "access denied" in e.why
    text = e.one_line()
    assert FAKE_AWS_ACCESS_KEY_ID not in text and "abc123" not in text
    assert "AKIAOTHERFAKEKEY0000" not in text
    pre = ClientError(
        {"Error": {"Code": "PreconditionFailed"}, "ResponseMetadata": {"HTTPStatusCode": 412}},
        "PutObject",
    )
    assert isinstance(translate_error(pre, "k", condition="if_absent"), AlreadyExistsError)
    assert isinstance(translate_error(pre, "k", condition="if_match"), ConflictError)


@pytest.mark.s3
def test_moto_supports_both_conditional_writes(s3_bucket, s3_env):
    """The conditions are evaluated by the server, not emulated by the client."""
    client = boto3.client("s3")
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as e:
        client.put_object(Bucket=s3_bucket, Key="k", Body=b"2", IfNoneMatch="*")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    etag = client.head_object(Bucket=s3_bucket, Key="k")["ETag"]
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"3", IfMatch=etag)
    with pytest.raises(ClientError) as e:
        client.put_object(Bucket=s3_bucket, Key="k", Body=b"4", IfMatch=etag)
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"3"


def test_principal_is_the_aws_identity_on_s3_and_none_locally(s3_bucket, s3_env, tmp_path):
    assert LocalStore(tmp_path).principal() is None
    arn = open_store(f"s3://{s3_bucket}/p").principal()
    assert arn is not None and arn.startswith("arn:aws:")
    assert FAKE_AWS_ACCESS_KEY_ID not in arn


def test_store_keys_use_forward_slashes(tmp_path):
    s = LocalStore(tmp_path)
    s.put_bytes("a/b/c", b"x")
    assert list(s.list("a/")) == ["a/b/c"]
    assert Path(tmp_path, "a", "b", "c").read_bytes() == b"x"
