"""Publishing: only missing blobs, manifest last and only if absent, on both stores."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import boto3
import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.compile.release import publish_release
from pipeline.contracts.store_layout import blob_key, release_key
from pipeline.errors import AlreadyExistsError, IntegrityError, MissingBucketsError
from pipeline.plan.config import load_config
from pipeline.store import open_store
from pipeline.store.releases import read_release
from tests.conftest import (
    FAKE_AWS_ACCESS_KEY_ID,
    FAKE_AWS_SECRET_ACCESS_KEY,
    FAKE_AWS_SESSION_TOKEN,
)
from tests.store_helpers import (
    bucket_files,
    fake_compile,
    fake_key,
    fake_prepare,
    race,
    write_release_config,
)

runner = CliRunner()
FILES_PER_BUCKET = 3


@pytest.fixture
def use_fake_keys(monkeypatch):
    """The CLI resolves compile's key function; point it at the test's."""
    import pipeline.compile.release as publish_mod

    monkeypatch.setattr(publish_mod, "default_key_fn", lambda: fake_key)
    # fake_compile's entries hold each bucket's weights, as neuron's do
    monkeypatch.setattr(publish_mod, "default_weights_key_fn", lambda: publish_mod.no_weights_entry)


def _compiled(tmp_path: Path, cache_url: str, **kw):
    """A config whose compile cache (config store) is ``cache_url``, with every bucket done."""
    cfg = write_release_config(tmp_path, cache_url, **kw)
    release = load_config(cfg)
    fake_compile(release, open_store(cache_url), tmp_path)
    return cfg, release


def _assert_complete(store, model: str, version: str) -> None:
    """Every file the manifest names is in the store with its digest."""
    m = read_release(store, model, version)
    for _, ref in m.iter_files():
        data = store.get_bytes(blob_key(ref.sha256))
        assert len(data) == ref.size and hashlib.sha256(data).hexdigest() == ref.sha256


def test_publish_writes_a_manifest_naming_every_file_and_fact(store_url, tmp_path):
    cfg, release = _compiled(tmp_path, store_url, flags="--model-type=transformer -O2")
    r = publish_release(release, version="v1", key_fn=fake_key)
    assert r.created and r.version == "v1" and r.manifest == "models/tiny/releases/v1.json"
    assert r.files == 4 * FILES_PER_BUCKET + 1  # + the checkpoint's config.json
    assert r.uploaded_files == 1  # compile already put the bucket blobs in this store
    store = open_store(store_url)
    _assert_complete(store, "tiny", "v1")
    m = read_release(store, "tiny", "v1")
    assert m.schema_version == 3 and m.model == "tiny" and m.backend == "cpu"
    # compile (bucket files) and publish (checkpoint files) record part digests as they hash
    for _, ref in m.iter_files():
        data = store.get_bytes(blob_key(ref.sha256))
        assert ref.part_size and ref.parts == [
            hashlib.sha256(data[i : i + ref.part_size]).hexdigest()
            for i in range(0, len(data), ref.part_size)
        ]
    assert m.weights_digest == "ab" * 32
    assert m.grid == {"batch_sizes": [1, 2], "sequence_lengths": [32, 64]}
    assert m.gqa["tp"] == 2 and m.gqa["q_heads"] == 8 and m.gqa["kv_heads"] == 2
    assert m.target == {"instance_type": "inf2.xlarge", "tp_degree": 2, "gqa_strategy": "auto"}
    assert m.versions["torch"] == "2.13.0" and "inf2-pipeline" in m.versions
    assert m.flags == ["--model-type=transformer", "-O2"] and m.auto_cast_type == "fp32"
    assert m.config == yaml.safe_load(cfg.read_text())  # the source config, as written
    assert sorted(m.buckets) == ["b1_s32", "b1_s64", "b2_s32", "b2_s64"]
    b = m.buckets["b2_s64"]
    assert (b.batch, b.seq) == (2, 64)
    assert {f.path for f in b.files} == set(bucket_files(release.buckets[-1]))
    assert [f.path for f in m.files] == ["config.json"]


def test_republishing_unchanged_content_uploads_zero_bytes(store_url, tmp_path):
    """Compile cache on local disk, release store local or S3: the first publish copies every
    blob over, the second (a new version of the same content) uploads nothing."""
    _, release = _compiled(tmp_path, str(tmp_path / "cache"))
    dest = open_store(store_url)
    first = publish_release(release, store=dest, version="v1", key_fn=fake_key)
    assert first.uploaded_files == first.files and first.uploaded_bytes == first.total_bytes > 0
    second = publish_release(release, store=dest, version="v2", key_fn=fake_key)
    assert second.created and second.uploaded_bytes == 0 and second.uploaded_files == 0
    _assert_complete(dest, "tiny", "v2")


def test_a_release_that_changes_one_bucket_uploads_only_that_buckets_files(store_url, tmp_path):
    _, release = _compiled(tmp_path, str(tmp_path / "cache"))
    dest = open_store(store_url)
    publish_release(release, store=dest, version="v1", key_fn=fake_key)
    # Recompile one bucket with new output (as a flag or compiler change would).
    changed = fake_compile(
        release,
        open_store(str(tmp_path / "cache")),
        tmp_path / "again",
        files=lambda b: bucket_files(b, salt="-new"),
        only={"b1_s64"},
    )
    r = publish_release(release, store=dest, version="v2", key_fn=fake_key)
    assert r.uploaded_files == FILES_PER_BUCKET
    assert r.uploaded_bytes == sum(f.size for f in changed["b1_s64"].files)
    _assert_complete(dest, "tiny", "v2")


def test_an_existing_version_is_never_overwritten(store_url, tmp_path, use_fake_keys):
    cfg, release = _compiled(tmp_path, str(tmp_path / "cache"))
    store = open_store(store_url)
    publish_release(release, store=store, version="v1", key_fn=fake_key)
    before = store.get_bytes(release_key("tiny", "v1"))
    new = fake_compile(
        release,
        open_store(str(tmp_path / "cache")),
        tmp_path / "b",
        files=lambda b: bucket_files(b, "x"),
        only={"b1_s32"},
    )
    with pytest.raises(AlreadyExistsError, match="different content") as e:
        publish_release(release, store=store, version="v1", key_fn=fake_key)
    assert "another --version" in e.value.hint
    assert store.get_bytes(release_key("tiny", "v1")) == before
    # Refused before uploading anything: the new bucket's blobs never reached the store.
    assert not any(store.exists(blob_key(f.sha256)) for f in new["b1_s32"].files)
    r = runner.invoke(app, ["publish", str(cfg), "--version", "v1", "--store", store_url])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: release tiny v1: already exists in ")
    assert len(r.stderr.strip().splitlines()) == 1


def test_publishing_the_same_content_again_is_a_no_op(store_url, tmp_path):
    _, release = _compiled(tmp_path, store_url)
    publish_release(release, version="v1", key_fn=fake_key)
    again = publish_release(release, version="v1", key_fn=fake_key)
    assert not again.created and again.uploaded_bytes == 0


def test_default_version_is_the_utc_date_and_a_content_digest(store_url, tmp_path):
    _, release = _compiled(tmp_path, store_url)
    r = publish_release(release, key_fn=fake_key)
    today = datetime.now(timezone.utc).strftime("%Y%m%d")
    assert re.fullmatch(rf"{today}-[0-9a-f]{{8}}", r.version)
    m = read_release(open_store(store_url), "tiny", r.version)
    assert r.version.endswith(m.content_digest()[:8]) and r.content_digest == m.content_digest()
    assert not publish_release(release, key_fn=fake_key).created  # same content, same version


def test_missing_buckets_are_named_and_nothing_is_published(tmp_path, use_fake_keys):
    cfg = write_release_config(tmp_path, str(tmp_path / "store"))
    release = load_config(cfg)
    fake_compile(release, open_store(str(tmp_path / "store")), tmp_path, only={"b1_s32"})
    with pytest.raises(MissingBucketsError, match="3 of 4 buckets: b1_s64, b2_s32, b2_s64"):
        publish_release(release, key_fn=fake_key)
    r = runner.invoke(app, ["publish", str(cfg)])
    assert r.exit_code == 2 and "inf2-pipeline compile" in r.stderr
    assert list(open_store(str(tmp_path / "store")).list("models/")) == []


def test_auto_backend_publishes_the_backend_that_compiled_every_bucket(tmp_path):
    cfg = write_release_config(tmp_path, str(tmp_path / "s"), backend="auto")
    release = load_config(cfg)
    store = open_store(str(tmp_path / "s"))
    fake_compile(release, store, tmp_path, backend="cpu", only={"b1_s32"})
    fake_compile(release, store, tmp_path, backend="cuda")
    r = publish_release(release, version="v1", key_fn=fake_key)
    assert read_release(store, "tiny", r.version).backend == "cuda"


def test_corrupted_cache_blobs_are_not_republished(store_url, tmp_path):
    cache = tmp_path / "cache"
    _, release = _compiled(tmp_path, str(cache))
    victim = next(cache.glob("blobs/sha256/*"))
    victim.write_bytes(b"bit rot")
    with pytest.raises(IntegrityError, match="does not match its digest"):
        publish_release(release, store=open_store(store_url), version="v1", key_fn=fake_key)
    assert list(open_store(store_url).list("models/")) == []


def test_two_concurrent_publishes_of_one_version_have_one_winner(store_url, tmp_path):
    """Two caches with different content, one destination, same version, started together:
    exactly one wins, the other is told the version exists, and the stored release is
    wholly the winner's."""
    releases = []
    for side in ("a", "b"):
        cfg = write_release_config(tmp_path / side, str(tmp_path / side / "cache"))
        release = load_config(cfg)
        fake_compile(
            release,
            open_store(str(tmp_path / side / "cache")),
            tmp_path / side,
            files=lambda b, side=side: bucket_files(b, salt=side),
        )
        releases.append(release)
    dests = [open_store(store_url), open_store(store_url)]
    for round_ in range(3):
        version = f"v{round_}"
        results, errors = race(
            2,
            lambda i, version=version: publish_release(
                releases[i], store=dests[i], version=version, key_fn=fake_key
            ),
        )
        assert len(results) == 1 and len(errors) == 1, (results, errors)
        (winner,) = results.values()
        (loser,) = errors.values()
        assert isinstance(loser, AlreadyExistsError)
        assert f"release tiny {version}" in str(loser) and "different content" in str(loser)
        stored = read_release(open_store(store_url), "tiny", version)
        assert stored.content_digest() == winner.content_digest
        _assert_complete(open_store(store_url), "tiny", version)


@pytest.mark.s3
def test_a_plain_boto3_client_can_list_and_download_a_release(s3_bucket, tmp_path):
    """No pipeline code on the reading side: list the releases, read the manifest, fetch
    every file by its digest, check it."""
    _, release = _compiled(tmp_path, str(tmp_path / "cache"))
    publish_release(
        release, store=open_store(f"s3://{s3_bucket}/team/store"), version="v7", key_fn=fake_key
    )
    s3 = boto3.client("s3")
    listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="team/store/models/tiny/releases/")
    assert [o["Key"] for o in listed["Contents"]] == ["team/store/models/tiny/releases/v7.json"]
    manifest = json.loads(
        s3.get_object(Bucket=s3_bucket, Key=listed["Contents"][0]["Key"])["Body"].read()
    )
    out = tmp_path / "download"
    files = [("", f) for f in manifest["files"]] + [
        (f"buckets/{name}/", f) for name, b in manifest["buckets"].items() for f in b["files"]
    ]
    for where, f in files:
        path = out / where / f["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(s3_bucket, f"team/store/blobs/sha256/{f['sha256']}", str(path))
        assert hashlib.sha256(path.read_bytes()).hexdigest() == f["sha256"]
        assert path.stat().st_size == f["size"]
    assert len(files) == 13
    assert (out / "buckets/b1_s32/prefill.pt2").read_bytes() == bucket_files(release.buckets[0])[
        "prefill.pt2"
    ]


@pytest.mark.s3
def test_no_credentials_in_outputs_errors_manifests_or_pointers(s3_bucket, tmp_path, use_fake_keys):
    url = f"s3://{s3_bucket}/artifacts"
    cfg, _ = _compiled(tmp_path, str(tmp_path / "cache"))
    outputs = []

    def cli(*args: str) -> None:
        r = runner.invoke(app, [*args])
        outputs.append(r.stdout + r.stderr)

    cli("publish", str(cfg), "--store", url, "--version", "v1")
    cli("publish", str(cfg), "--store", url, "--version", "v2", "--json")
    cli("promote", "tiny", "v1", "--channel", "prod", "--store", url, "--json")
    cli("list", "--store", url)
    cli("show", "tiny", "--channel", "prod", "--store", url, "--json")
    cli("diff", "tiny", "v1", "v2", "--store", url)
    cli("gc", "tiny", "--keep", "1", "--store", url, "--json")
    cli("show", "tiny", "v9", "--store", url)  # errors
    cli("list", "--store", "s3://no-such-bucket-anywhere/x")
    cli("--debug", "show", "tiny", "v9", "--store", url)
    # A real process too, as CI would run it (its stderr includes any logging).
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pipeline.cli import main; main()",
            "--debug",
            "promote",
            "tiny",
            "v404",
            "--channel",
            "prod",
            "--store",
            url,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    outputs.append(proc.stdout + proc.stderr)
    assert "release tiny v404" in proc.stderr
    s3 = boto3.client("s3")
    stored = [
        s3.get_object(Bucket=s3_bucket, Key=o["Key"])["Body"].read().decode()
        for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="artifacts/models/")["Contents"]
    ]
    assert len(stored) == 3  # two manifests and the channel pointer
    assert "arn:aws:" in " ".join(stored)  # the pointer records the identity, not the keys
    everything = "\n".join(outputs + stored)
    for secret in (FAKE_AWS_ACCESS_KEY_ID, FAKE_AWS_SECRET_ACCESS_KEY, FAKE_AWS_SESSION_TOKEN):
        assert secret not in everything


def test_publish_cli_finds_entries_under_the_compile_stages_keys(tmp_path, tiny_checkpoint):
    """No stand-in here: `publish CONFIG` computes keys with compile's bucket_cache_key."""
    from pipeline.compile.keys import bucket_cache_key

    cfg = write_release_config(tmp_path, str(tmp_path / "store"))
    text = cfg.read_text().replace(str(tmp_path / "ckpt"), str(tiny_checkpoint))
    cfg.write_text(text)
    release = load_config(cfg)
    store = open_store(str(tmp_path / "store"))
    entries = fake_compile(release, store, tmp_path, key_fn=bucket_cache_key)
    r = runner.invoke(app, ["publish", str(cfg), "--version", "v1", "--json"])
    assert r.exit_code == 2  # graphs alone are not a release: the weights are cached apart
    assert "the prepared weights of this checkpoint are not in the cache" in r.stderr
    weights = fake_prepare(release, store, tmp_path)
    r = runner.invoke(app, ["publish", str(cfg), "--version", "v1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["created"] is True
    m = read_release(store, "tiny", "v1")
    assert {n: b.cache_key for n, b in m.buckets.items()} == {n: e.key for n, e in entries.items()}
    assert {b.weights_key for b in m.buckets.values()} == {weights.key}
    for name, b in m.buckets.items():  # each bucket: its graphs, then the shared weights
        assert b.files == [*entries[name].files, *weights.files]
    assert {f.path for f in m.files} >= {"config.json"}
