"""Per-part digests (manifest schema 2): computed once at publish, sent as S3 multipart part
checksums, checked at pull as each part lands; a bad part is fetched again, alone.

The fault tests put a fault-injecting proxy (tests/fault_proxy.py) between boto3 and moto's
server and corrupt one byte of chosen ranged GETs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import blake3
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.contracts.store_layout import blob_key, release_key
from pipeline.errors import (
    IntegrityError,
    ManifestError,
    NotFoundError,
    PipelineError,
    RuntimeMismatchError,
    StoreError,
)
from pipeline.install import landing
from pipeline.install.fetcher import FILES_IN_TURN, interleaved
from pipeline.install.landing import FILE_RETRIES, PART_RETRIES
from pipeline.install.pull import available_cpus, default_concurrency, pull_release
from pipeline.store import open_store
from pipeline.store.manifest import MANIFEST_SCHEMA, parse_manifest
from pipeline.store.publish import publish
from pipeline.store.refs import FileRef, file_ref, hash_file
from tests.fault_proxy import FaultProxy, ranged_get_of
from tests.release_factory import make_release

runner = CliRunner()
PART = 1 << 16  # small manifest parts so that small files have many


@pytest.fixture
def store(store_url):
    return open_store(store_url)


def _big(n: int = 10 * PART + 123) -> bytes:
    return os.urandom(n)


def test_hash_file_gives_whole_and_part_digests_in_one_read(tmp_path):
    data = _big()
    path = tmp_path / "f"
    path.write_bytes(data)
    digest, size, parts = hash_file(path, PART)
    assert (digest, size) == (hashlib.sha256(data).hexdigest(), len(data))
    want = [hashlib.sha256(data[i : i + PART]).hexdigest() for i in range(0, len(data), PART)]
    assert parts == want and len(parts) == 11
    ref = file_ref(path, "f", PART)
    assert ref.parts == want and ref.part_size == PART
    assert ref.parts_blake3 == [
        blake3.blake3(data[i : i + PART]).hexdigest() for i in range(0, len(data), PART)
    ]
    assert ref.part_hash == "blake3"
    (tmp_path / "empty").write_bytes(b"")
    assert hash_file(tmp_path / "empty", PART)[2] == []
    exact = tmp_path / "exact"
    exact.write_bytes(data[: 2 * PART])
    assert len(hash_file(exact, PART)[2]) == 2


def test_a_ref_without_parts_serialises_as_schema_1_did():
    ref = FileRef(path="a", sha256="0" * 64, size=3)
    assert json.loads(ref.model_dump_json()) == {"path": "a", "sha256": "0" * 64, "size": 3}
    with pytest.raises(ValueError, match="part digests for"):
        FileRef(path="a", sha256="0" * 64, size=3 * PART, part_size=PART, parts=["0" * 64])
    with pytest.raises(ValueError, match="go together"):
        FileRef(path="a", sha256="0" * 64, size=3, part_size=PART)
    with pytest.raises(ValueError, match="one digest for each"):
        FileRef(path="a", sha256="0" * 64, size=3, part_size=PART, parts=["0" * 64],
                parts_blake3=[])  # fmt: skip
    # schema 2's shape: sha256 parts, no BLAKE3 key at all
    two = FileRef(path="a", sha256="0" * 64, size=3, part_size=PART, parts=["0" * 64])
    assert "parts_blake3" not in json.loads(two.model_dump_json()) and two.part_hash == "sha256"


def test_publish_records_part_digests_and_pull_checks_every_part(store, tmp_path, monkeypatch):
    data = _big()
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=PART)
    ref = m.buckets["b1_s32"].files[0]
    stored = parse_manifest(store.get_bytes(release_key("m", "v1")), "m v1")
    assert stored.schema_version == MANIFEST_SCHEMA == 3
    assert stored.buckets["b1_s32"].files[0].parts == ref.parts
    assert ref.parts == [
        hashlib.sha256(data[i : i + PART]).hexdigest() for i in range(0, len(data), PART)
    ]
    import pipeline.install.landing as landing

    checked = []
    real = landing.part_matches

    def spy(ref, i, data):  # counts the part checks pull makes, and by which digest
        checked.append((len(data), ref.part_hash))
        return real(ref, i, data)

    monkeypatch.setattr(landing, "part_matches", spy)
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=4 * PART)
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
    want = [len(data[i : i + PART]) for i in range(0, len(data), PART)]
    assert sorted(checked) == sorted(
        (n, "blake3") for n in [*want, len(b'{"model_type": "llama"}')]
    )
    assert r.parts == 3 + 1 and r.refetched_parts == 0 and r.refetched_files == 0


@pytest.mark.s3
def test_s3_multipart_parts_carry_the_manifest_part_checksums(s3_store_url, tmp_path):
    """The blob is uploaded in the manifest's parts, each with its SHA-256: moto's composite
    checksum (sha256 over the part digests) matches the manifest's parts."""
    store = open_store(s3_store_url)
    part = 5 << 20  # S3's smallest multipart part
    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(2 * part + 1000))
    ref = file_ref(path, "w.bin", part)
    sent: list[bytes | str] = []
    store.client.meta.events.register(
        "before-send.s3.UploadPart",
        lambda request, **_: sent.append(request.headers.get("x-amz-checksum-sha256", b"")),
    )
    manifest = make_release(store, tmp_path, version="v0")  # a template to reuse
    manifest = manifest.model_copy(
        update={
            "buckets": {"b1_s32": manifest.buckets["b1_s32"].model_copy(update={"files": [ref]})},
            "files": [],
        }
    )
    publish(store, manifest, {ref.sha256: path}, version="v1")
    b64 = [base64.b64encode(bytes.fromhex(p)).decode() for p in ref.parts or []]
    assert len(b64) == 3 and sorted(
        s.decode() if isinstance(s, bytes) else s for s in sent
    ) == sorted(b64)
    head = store.client.head_object(
        Bucket=store.bucket, Key=store._key(blob_key(ref.sha256)), ChecksumMode="ENABLED"
    )
    composite = hashlib.sha256(b"".join(bytes.fromhex(p) for p in ref.parts or [])).digest()
    assert head["ChecksumSHA256"].split("-")[0] == base64.b64encode(composite).decode()
    r = pull_release(store, "m", tmp_path / "d", version="v1")
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == path.read_bytes()


def _through_proxy(monkeypatch, s3_env: str, store_url: str, corrupt, times=1, tls=None):
    """The fault proxy in front of moto, and a store through it; ``tls``: (cert, key) to
    serve https, which the client trusts (AWS_CA_BUNDLE): the landing then streams."""
    proxy = FaultProxy(s3_env, corrupt, times, tls=tls)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    if tls is not None:
        monkeypatch.setenv("AWS_CA_BUNDLE", tls[0])
    store = open_store(store_url)
    assert store.streams_ranges() is (tls is not None)
    return proxy, store


@pytest.mark.s3
@pytest.mark.parametrize("https", [False, True], ids=["http", "https-streamed"])
def test_a_range_corrupted_once_is_refetched_alone_and_reported(
    s3_store_url, s3_env, tmp_path, monkeypatch, self_signed, https
):
    data = _big(20 * PART + 7)
    m = make_release(open_store(s3_store_url), tmp_path, buckets={"b1_s32": {"w.bin": data}},
                     part_size=PART)  # fmt: skip
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    tls = self_signed if https else None
    proxy, _ = _through_proxy(
        monkeypatch, s3_env, s3_store_url, ranged_get_of(key, 8 * PART), tls=tls
    )
    dest = tmp_path / "d"
    with proxy:
        r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(dest), "--store",
                                s3_store_url, "--part-size", "256KiB", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert proxy.hits and proxy.hits[0][2].startswith(f"bytes={8 * PART}-")
    assert out["refetched_parts"] == 1 and out["refetched_files"] == 0
    assert out["parts"] == 6 + 1  # 20 parts + 7 bytes in 4-part ranges; the config file
    assert out["downloaded_bytes"] == len(data) + PART + len(b'{"model_type": "llama"}')
    assert out["throughput"] > 0 and out["seconds"] > 0
    assert (dest / "m/current/buckets/b1_s32/w.bin").read_bytes() == data
    # The plain summary says it too.
    with FaultProxy(s3_env, ranged_get_of(key, 0), tls=tls) as proxy2:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy2.url)
        r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(tmp_path / "e"),
                                "--store", s3_store_url, "--part-size", "64KiB"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert re.search(r"in 22 parts .* re-fetched 1 parts, 0 files", r.stdout), r.stdout


@pytest.mark.s3
def test_schema_1_file_corrupted_once_is_refetched_whole(
    s3_store_url, s3_env, tmp_path, monkeypatch
):
    """issue 14, part 3: no part digests, so the file is checked whole and fetched again."""
    data = _big(5 * PART)
    m = make_release(open_store(s3_store_url), tmp_path, buckets={"b1_s32": {"w.bin": data}},
                     part_size=None, schema=1)  # fmt: skip
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    proxy, store = _through_proxy(monkeypatch, s3_env, s3_store_url, ranged_get_of(key, 2 * PART))
    with proxy:
        r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=PART)
    assert len(proxy.hits) == 1
    assert (r.refetched_files, r.refetched_parts) == (1, 0)
    assert r.downloaded_bytes == 2 * len(data) + len(b'{"model_type": "llama"}')
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data


@pytest.mark.s3
@pytest.mark.parametrize("https", [False, True], ids=["http", "https-streamed"])
def test_persistent_corruption_fails_with_exit_1_after_bounded_refetches(
    s3_store_url, s3_env, tmp_path, monkeypatch, self_signed, https
):
    make_release(open_store(s3_store_url), tmp_path, version="v1", part_size=PART)
    m2 = make_release(open_store(s3_store_url), tmp_path, version="v2",
                      buckets={"b1_s32": {"w.bin": _big()}}, part_size=PART)  # fmt: skip
    dest = tmp_path / "d"
    pull_release(open_store(s3_store_url), "m", dest, version="v1")
    before = {p: p.read_bytes() for p in (dest / "m/v1").rglob("*") if p.is_file()}
    key = blob_key(m2.buckets["b1_s32"].files[0].sha256)
    proxy, _ = _through_proxy(
        monkeypatch, s3_env, s3_store_url, ranged_get_of(key, 3 * PART), times=None,
        tls=self_signed if https else None,
    )  # fmt: skip
    with proxy:
        r = runner.invoke(app, ["pull", "m", "--version", "v2", "--dest", str(dest), "--store",
                                s3_store_url, "--part-size", "64KiB"])  # fmt: skip
    assert r.exit_code == 1, r.output
    assert r.stderr.count("\n") == 1 and "blake3 mismatch in part 3" in r.stderr
    assert f"after {PART_RETRIES} re-fetches" in r.stderr
    assert len(proxy.hits) == 1 + PART_RETRIES
    assert os.readlink(dest / "m/current") == "v1" and not (dest / "m/v2").exists()
    assert {p: p.read_bytes() for p in (dest / "m/v1").rglob("*") if p.is_file()} == before
    # what stays for a resume is in the staging directory (streamed, it may hold unchecked
    # bytes: a resume checks every part before it keeps one)
    assert all(".staging-v2" in str(p) for p in (dest / "m").rglob("*.incomplete"))


def test_schema_1_manifests_still_pull_verified_whole(store, tmp_path):
    data = _big(3 * PART + 5)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data, "s.bin": b"abc"}},
                     part_size=None, schema=1)  # fmt: skip
    raw = json.loads(store.get_bytes(release_key("m", "v1")))
    assert raw["schema_version"] == 1 and "parts" not in raw["buckets"]["b1_s32"]["files"][0]
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=PART)
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
    assert r.parts == 4 + 1 + 1 and r.refetched_files == 0
    # corrupt in the store (same size): whole-file check, bounded whole re-fetches, then fail
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    store.put_bytes(key, data[:PART] + bytes([data[PART] ^ 0xFF]) + data[PART + 1 :])  # flipped
    calls = []
    real = store.read_range_into
    store.read_range_into = lambda k, s, b: (calls.append(k) if k == key else None) or real(k, s, b)
    with pytest.raises(IntegrityError, match=f"after {FILE_RETRIES} whole-file re-fetches"):
        pull_release(store, "m", tmp_path / "e", version="v1", part_size=PART)
    assert len(calls) == 4 * (1 + FILE_RETRIES)
    assert not (tmp_path / "e/m/v1").exists()


def test_schema_2_manifests_still_pull_checked_by_sha256_parts(store, tmp_path):
    """A release published before BLAKE3 part digests: every part checked by its sha256, a
    corrupted one caught and re-fetched alone."""
    data = _big(4 * PART + 7)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=PART,
                     schema=2)  # fmt: skip
    raw = json.loads(store.get_bytes(release_key("m", "v1")))
    assert raw["schema_version"] == 2 and "parts_blake3" not in raw["buckets"]["b1_s32"]["files"][0]
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=PART)
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data and r.refetched_parts == 0
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    real, bad = store.read_range_into, [True]

    def flip_once(k, start, buf):  # the first read of part 2 comes back with a flipped byte
        n = real(k, start, buf)
        if k == key and start == 2 * PART and bad and bad.pop():
            buf[0] ^= 0xFF
        return n

    store.read_range_into = flip_once
    r = pull_release(store, "m", tmp_path / "e", version="v1", part_size=PART)
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data and r.refetched_parts == 1


def test_a_forged_blake3_digest_is_caught(store, tmp_path):
    """The BLAKE3 digests are what pull checks: one that does not match the bytes (the sha256
    ones untouched) fails the pull, whatever the sha256 parts say."""
    make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": _big(3 * PART)}}, part_size=PART)
    raw = json.loads(store.get_bytes(release_key("m", "v1")))
    raw["buckets"]["b1_s32"]["files"][0]["parts_blake3"][1] = "0" * 64
    raw["version"] = "v2"
    store.put_bytes(release_key("m", "v2"), json.dumps(raw).encode())
    with pytest.raises(IntegrityError, match="blake3 mismatch in part 1"):
        pull_release(store, "m", tmp_path / "d", version="v2", part_size=PART)
    assert not (tmp_path / "d/m/v2").exists()


def test_verify_full_checks_the_whole_digest_too(store, tmp_path):
    """Part digests that match but a whole digest that does not (a forged manifest): only
    --verify full notices."""
    good, other = _big(4 * PART), _big(4 * PART)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": good}}, part_size=PART)
    ref = m.buckets["b1_s32"].files[0]
    forged = hashlib.sha256(other).hexdigest()
    store.put_bytes(blob_key(forged), good)
    raw = json.loads(store.get_bytes(release_key("m", "v1")))
    raw["buckets"]["b1_s32"]["files"][0]["sha256"] = forged
    raw["version"] = "v2"
    store.put_bytes(release_key("m", "v2"), json.dumps(raw).encode())
    assert pull_release(store, "m", tmp_path / "a", version="v2").refetched_files == 0
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        pull_release(store, "m", tmp_path / "b", version="v2", verify="full")
    r = pull_release(store, "m", tmp_path / "c", version="v1", verify="full")
    assert r.verify == "full" and (r.path / "buckets/b1_s32/w.bin").read_bytes() == good
    assert ref.sha256 == hashlib.sha256(good).hexdigest()


def test_newer_schema_is_refused_with_upgrade_and_exit_2(store, tmp_path):
    make_release(store, tmp_path)
    raw = json.loads(store.get_bytes(release_key("m", "v1")))
    raw.update(schema_version=MANIFEST_SCHEMA + 1, version="v3")
    store.put_bytes(release_key("m", "v3"), json.dumps(raw).encode())
    with pytest.raises(RuntimeMismatchError, match="upgrade inf2-pipeline"):
        pull_release(store, "m", tmp_path / "d", version="v3")
    r = runner.invoke(app, ["pull", "m", "--version", "v3", "--dest", str(tmp_path / "d"),
                            "--store", store.url])  # fmt: skip
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert f"schema {MANIFEST_SCHEMA + 1} is newer" in r.stderr
    assert "upgrade inf2-pipeline" in r.stderr
    assert not (tmp_path / "d/m/v3").exists()


def test_part_digests_that_do_not_cover_the_file_are_a_malformed_manifest(store, tmp_path):
    make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": _big()}}, part_size=PART)
    raw = json.loads(store.get_bytes(release_key("m", "v1")))
    raw["buckets"]["b1_s32"]["files"][0]["parts"].pop()
    raw["version"] = "v4"
    store.put_bytes(release_key("m", "v4"), json.dumps(raw).encode())
    with pytest.raises(ManifestError, match="part digests for"):
        pull_release(store, "m", tmp_path / "d", version="v4")
    r = runner.invoke(app, ["pull", "m", "--version", "v4", "--dest", str(tmp_path / "d"),
                            "--store", store.url])  # fmt: skip
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output


def test_part_size_flag_is_checked():
    r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", "/tmp/x",
                            "--part-size", "12 parsecs"])  # fmt: skip
    assert r.exit_code == 2 and "--part-size" in r.stderr


def test_default_concurrency_suits_small_and_large_nodes():
    assert default_concurrency(1) == default_concurrency(2) == 8
    assert default_concurrency(4) == 16
    assert default_concurrency(192) == 32
    # a streamed range holds 1 MiB, not a part: more in flight where CPUs keep them busy
    assert default_concurrency(2, streamed=True) == 8
    assert default_concurrency(16, streamed=True) == 64  # the 16-core host measured
    # S3: ~88 MB/s a connection (AWS), so an inf2.48xlarge's 100 Gbps wants ~143 in flight
    assert default_concurrency(36, streamed=True) == default_concurrency(192, streamed=True) == 144


@pytest.mark.parametrize(
    ("streamed", "schema", "want"),
    [(False, 3, 32), (True, 3, 64), (True, 1, 32)],
    ids=["buffered", "streamed", "streamed-store-schema-1"],
)
def test_a_pull_s_default_concurrency_follows_whether_its_ranges_stream(
    store, tmp_path, monkeypatch, streamed, schema, want
):
    """Up to 64 in flight where every range streams (1 MiB each); a file without part
    digests is read a whole range at a time, so its release keeps the cap of 32."""
    import pipeline.install.pull as pull_mod

    monkeypatch.setattr(type(store), "streams_ranges", lambda self: streamed)
    monkeypatch.setattr(pull_mod, "available_cpus", lambda: 16)
    data = _big(4 * PART)
    parts = PART if schema > 1 else None
    make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=parts,
                 schema=schema)  # fmt: skip
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=PART, processes=1)
    assert r.concurrency == want
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data


def test_available_cpus_follows_the_cgroup_limit(tmp_path, monkeypatch):
    import pipeline.install.pull as pull_mod

    affinity = len(os.sched_getaffinity(0))
    limit = tmp_path / "cpu.max"
    monkeypatch.setattr(pull_mod, "CGROUP_CPU_MAX", limit)
    limit.write_text("max 100000\n")  # no limit: the affinity mask decides
    assert available_cpus() == affinity
    limit.write_text("150000 100000\n")  # 1.5 CPUs: rounds up to 2, never above affinity
    assert available_cpus() == min(affinity, 2)
    limit.write_text("10000 100000\n")  # a tenth of a CPU still counts as one
    assert available_cpus() == 1


# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from the forked parent (a
# test process holding the release), VmHWM belongs to the new process image alone.
PEAK_RSS = """
import sys
from pathlib import Path
from pipeline.store import open_store
from pipeline.install.pull import pull_release
r = pull_release(open_store(sys.argv[1]), "m", Path(sys.argv[2]), version="v1",
                 concurrency=int(sys.argv[3]), part_size=int(sys.argv[4]))
hwm = open("/proc/self/status").read().split("VmHWM:")[1].split()[0]
print(int(hwm) * 1024, r.downloaded_bytes)
"""


def test_peak_memory_of_a_pull_stays_near_concurrency_times_part_size(tmp_path):
    """A 256 MiB release pulled in a fresh process: its peak RSS is reported; the assertion
    is the issue's loose bound (2 x concurrency x part size + 200 MiB), not a tight one."""
    store = open_store(str(tmp_path / "store"))
    block = os.urandom(1 << 20)
    files = {f"w{i}.bin": block * 64 + bytes([i]) for i in range(4)}  # 4 x 64 MiB, distinct
    make_release(store, tmp_path, buckets={"b1_s32": files})
    del files
    concurrency, part = 4, 16 << 20
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, store.url, str(tmp_path / "d"), str(concurrency),
         str(part)],
        capture_output=True, text=True, cwd=Path(__file__).parent.parent, check=True,
    )  # fmt: skip
    peak, downloaded = map(int, out.stdout.split())
    print(f"peak RSS {peak / 2**20:.0f} MiB pulling {downloaded / 2**20:.0f} MiB "
          f"(concurrency {concurrency}, part {part >> 20} MiB)")  # fmt: skip
    assert downloaded > 256 << 20
    assert peak <= 2 * concurrency * part + (200 << 20)


def test_a_full_disk_is_one_line_and_exit_1(store, tmp_path, monkeypatch):
    import errno

    import pipeline.install.pull as pull_mod

    make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": _big()}}, part_size=PART)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pull_mod.os, "pwrite", full)
    r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(tmp_path / "d"),
                            "--store", store.url])  # fmt: skip
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.output
    assert "No space left on device" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "d/m/v1").exists()


@pytest.mark.parametrize("streamed", [False, True], ids=["buffered", "streamed"])
def test_a_half_fetched_file_resumes_from_its_verified_parts(
    store, tmp_path, monkeypatch, streamed
):
    """What a SIGKILL leaves: a full-size temporary file with some parts written. The parts
    that verify are kept; the others (zeros, or torn writes) are fetched. A store whose
    ranges stream (over TLS) resumes the same way: its parts on disk are checked first."""
    monkeypatch.setattr(type(store), "streams_ranges", lambda self: streamed)
    if streamed:  # checked and landed a MiB at a time: no range-sized buffer is made
        monkeypatch.setattr(landing, "_buffer", lambda n: pytest.fail("a range buffer"))
    data = _big(8 * PART)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=PART)
    tmp = tmp_path / "d/m/.staging-v1/buckets/b1_s32/.w.bin.incomplete"
    tmp.parent.mkdir(parents=True)
    torn = bytearray(len(data))
    torn[: 3 * PART] = data[: 3 * PART]  # parts 0-2 landed
    torn[5 * PART : 5 * PART + 10] = data[5 * PART : 5 * PART + 10]  # part 5 torn
    tmp.write_bytes(bytes(torn))
    calls = []
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    if streamed:  # the range's one read (a local store's reads a chunk each under it)
        through = store.read_range_through
        store.read_range_through = lambda k, s, n, c, sink: (
            (calls.append(s) if k == key else None) or through(k, s, n, c, sink)
        )
    else:
        real = store.read_range_into
        store.read_range_into = lambda k, s, b: (
            (calls.append(s) if k == key else None) or real(k, s, b)
        )
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=PART)
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
    assert sorted(calls) == [i * PART for i in range(3, 8)]
    assert r.reused_bytes == 3 * PART and r.downloaded_bytes == 5 * PART + len(
        b'{"model_type": "llama"}'
    )


def test_a_file_is_preallocated_only_once_its_first_range_has_arrived(store, tmp_path):
    """Preallocating a large file can take a while (tmpfs zeroes its pages): the GETs of its
    ranges go out first, and a file whose GETs all fail is never created."""
    data = _big(8 * PART)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=PART)
    tmp = tmp_path / "d/m/.staging-v1/buckets/b1_s32/.w.bin.incomplete"
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    real = store.read_range_into
    seen = []

    def read(k, start, buf):
        if k == key:
            seen.append(tmp.exists())
        return real(k, start, buf)

    store.read_range_into = read
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=2 * PART, concurrency=1)
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == data
    assert seen == [False, True, True, True]  # one thread: the first GET came before the file

    def refused(k, start, buf):
        if k == key:
            raise NotFoundError(key, "gone", "republish")
        return real(k, start, buf)

    store.read_range_into = refused
    with pytest.raises(NotFoundError):
        pull_release(store, "m", tmp_path / "e", version="v1", part_size=2 * PART)
    assert not list((tmp_path / "e").rglob("*.incomplete"))


def test_ranges_of_large_files_are_fetched_in_turn(store, tmp_path):
    """One range of each file in turn, so the threads spread over the files rather than all
    writing into one (writes into a file serialise on its inode lock)."""
    files = {"a.bin": _big(6 * PART), "b.bin": _big(4 * PART), "c.bin": b"small"}
    m = make_release(store, tmp_path, buckets={"b1_s32": files}, part_size=PART)
    names = {blob_key(r.sha256): r.path.rsplit("/", 1)[-1] for r in m.buckets["b1_s32"].files}
    real = store.read_range_into
    order = []

    def read(k, start, buf):
        if k in names:
            order.append(names[k])
        return real(k, start, buf)

    store.read_range_into = read
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=2 * PART, concurrency=1)
    for name, data in files.items():
        assert (r.path / "buckets/b1_s32" / name).read_bytes() == data
    assert order == ["a.bin", "b.bin", "c.bin", "a.bin", "b.bin", "a.bin"], order


def test_files_taken_in_turn_are_bounded():
    """A release of many multi-range files keeps at most FILES_IN_TURN of them started and
    not finished (each is an open file descriptor), and still yields every range once."""
    files = [SimpleNamespace(ranges=[(i, 1), (i + 1, 1), (i + 2, 1)]) for i in range(200)]
    left = {id(f): len(f.ranges) for f in files}
    started, most, seen = set(), 0, []
    for f, r in interleaved(files):  # type: ignore[arg-type]
        seen.append((id(f), r))
        started.add(id(f))
        left[id(f)] -= 1
        if not left[id(f)]:
            started.discard(id(f))
        most = max(most, len(started))
    assert most == FILES_IN_TURN
    assert sorted(seen) == sorted((id(f), r) for f in files for r in f.ranges)


def _local_release(tmp_path, data: bytes):
    from pipeline.store.local import LocalStore

    store = LocalStore(tmp_path / "store")
    make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": data}}, part_size=PART)
    return store


def test_an_interrupted_system_call_in_a_worker_fails_the_pull(tmp_path, monkeypatch):
    """An OSError with EINTR is an InterruptedError: it once passed for the fetch's own
    "stopped" marker, and the pull installed a release with a file missing."""
    import errno

    store = _local_release(tmp_path, _big(4 * PART))
    real = store.read_range_into

    def interrupted(key, start, buf):
        if start >= 2 * PART:
            raise OSError(errno.EINTR, "Interrupted system call")
        return real(key, start, buf)

    store.read_range_into = interrupted
    import pipeline.install.landing as landing

    monkeypatch.setattr(landing, "with_retries", lambda fn: fn())
    with pytest.raises(InterruptedError):
        pull_release(store, "m", tmp_path / "d", version="v1", part_size=PART)
    assert not (tmp_path / "d/m/v1").exists() and not (tmp_path / "d/m/current").exists()


def test_a_thread_that_cannot_start_fails_cleanly(tmp_path, monkeypatch):
    """A container's pids limit: the threads already started are stopped and joined, and
    the CLI says it in one line (exit 1)."""
    import threading

    store = _local_release(tmp_path, _big(8 * PART))
    real_start, started = threading.Thread.start, []

    def start(self):
        if self.name.startswith("pull-") and started:
            raise RuntimeError("can't start new thread")
        started.append(self)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(tmp_path / "d"),
                            "--store", store.url, "--part-size", "64KiB",
                            "--concurrency", "4"])  # fmt: skip
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.output
    assert "cannot start thread" in r.stderr and "--concurrency" in r.stderr
    assert started and not any(t.is_alive() for t in started)
    assert not (tmp_path / "d/m/v1").exists()


def test_a_failed_preallocation_closes_its_file(tmp_path, monkeypatch):
    import errno

    import pipeline.install.pull as pull_mod

    store = _local_release(tmp_path, _big(2 * PART))

    def unsupported(*_):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    def too_large(*_):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(pull_mod.os, "posix_fallocate", unsupported)
    monkeypatch.setattr(pull_mod.os, "ftruncate", too_large)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(PipelineError, match="File too large"):
            pull_release(store, "m", tmp_path / "d", version="v1", part_size=PART)
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("size", ["²MiB", "2GiB", "0", "1XB"])
def test_part_sizes_out_of_range_are_bad_input(size):
    r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", "/tmp/x",
                            "--part-size", size])  # fmt: skip
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "64 KiB to 1 GiB" in r.stderr


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ({"Body": b"0123456789"}, b"3456"),  # a server that ignores Range: the whole object
        ({"Body": b"3456", "ContentRange": "bytes 3-6/10"}, b"3456"),
    ],
)
def test_botocore_gets_keep_to_the_asked_range(reply, expected):
    """The botocore path (behind a proxy, after a region redirect) once copied a whole-object
    reply into a range's buffer: a ValueError traceback, or bytes from the wrong offset."""
    import io

    from pipeline.store.s3 import S3Store

    class Client:
        def get_object(self, **kw):
            assert kw["Range"] == "bytes=3-6"
            return {**reply, "Body": io.BytesIO(reply["Body"])}

    s = S3Store.__new__(S3Store)
    s.client, s.bucket, s.prefix, s.ranges = Client(), "b", "", None
    buf = memoryview(bytearray(4))
    assert s.read_range_into("k", 3, buf) == 4 and bytes(buf) == expected


def test_botocore_gets_refuse_a_range_from_elsewhere():
    import io

    from pipeline.store.s3 import S3Store

    class Client:
        def get_object(self, **kw):
            return {"Body": io.BytesIO(b"0123"), "ContentRange": "bytes 0-3/10"}

    s = S3Store.__new__(S3Store)
    s.client, s.bucket, s.prefix, s.ranges = Client(), "b", "", None
    with pytest.raises(StoreError, match="asked for bytes from 3, got 0"):
        s.read_range_into("k", 3, memoryview(bytearray(4)))
