"""gc: old releases go, then what nothing references; never what a kept release needs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.compile.release import publish_release
from pipeline.contracts.store_layout import BLOBS_PREFIX, blob_key
from pipeline.errors import NotFoundError
from pipeline.plan.config import load_config
from pipeline.store import open_store
from pipeline.store.blobs import put_blob
from pipeline.store.cache import read_cache_entry
from pipeline.store.channels import promote
from pipeline.store.gc import gc
from pipeline.store.releases import list_releases, read_release
from tests.store_helpers import bucket_files, fake_compile, fake_key, write_release_config

runner = CliRunner()


def _publish_versions(store_url, tmp_path, versions, model="tiny"):
    """One release per version, each compiled with different bytes (salt = version)."""
    for v in versions:
        cfg = write_release_config(tmp_path / model / v, store_url, model=model, flags=f"-{v}")
        release = load_config(cfg)
        fake_compile(
            release,
            open_store(store_url),
            tmp_path / model / v,
            files=lambda b, v=v: bucket_files(b, v),
        )
        publish_release(release, version=v, key_fn=fake_key)


def _needed_blobs(store, model):
    return {ref.sha256 for m in list_releases(store, model) for _, ref in m.iter_files()}


def _all_blobs(store):
    return {k[len(BLOBS_PREFIX) :] for k in store.list(BLOBS_PREFIX)}


def test_gc_keeps_the_newest_and_channel_releases_and_everything_they_need(store_url, tmp_path):
    _publish_versions(store_url, tmp_path, ["v1", "v2", "v3", "v4"])
    store = open_store(store_url)
    promote(store, "tiny", "v1", "prod")
    v2_keys = {b.cache_key for b in read_release(store, "tiny", "v2").buckets.values()}
    r = gc(store, "tiny", keep=2, grace_s=0)
    assert r.kept == ["v4", "v3", "v1"] and r.deleted_releases == ["v2"]
    assert [m.version for m in list_releases(store, "tiny")] == ["v4", "v3", "v1"]
    assert _needed_blobs(store, "tiny") <= _all_blobs(store)
    # v2's buckets (only v2 used them) are gone: cache entries and their blobs.
    assert set(r.deleted_cache_entries) == v2_keys
    assert all(read_cache_entry(store, k) is None for k in v2_keys)
    assert len(r.deleted_blobs) == 4 * 3 and r.freed_bytes > 0
    assert _all_blobs(store) == _needed_blobs(store, "tiny")


def test_dry_run_reports_and_deletes_nothing(store_url, tmp_path):
    _publish_versions(store_url, tmp_path, ["v1", "v2"])
    store = open_store(store_url)
    before = sorted(store.list(""))
    r = gc(store, "tiny", keep=1, grace_s=0, dry_run=True)
    assert r.dry_run and r.deleted_releases == ["v1"] and r.deleted_blobs
    assert sorted(store.list("")) == before


def test_orphans_younger_than_the_grace_period_are_spared(store_url, tmp_path):
    """A publish in flight has uploaded blobs and not yet written its manifest."""
    _publish_versions(store_url, tmp_path, ["v1"])
    store = open_store(store_url)
    in_flight = tmp_path / "in-flight.bin"
    in_flight.write_bytes(b"uploaded by a publish that has not written its manifest yet")
    ref, _ = put_blob(store, in_flight, "x")
    r = gc(store, "tiny", keep=1)  # default grace: 24 h
    assert r.deleted_blobs == [] and r.young_orphans == 1
    assert store.exists(blob_key(ref.sha256))
    r = gc(store, "tiny", keep=1, grace_s=0)
    assert r.deleted_blobs == [ref.sha256] and not store.exists(blob_key(ref.sha256))


def test_blobs_shared_with_another_model_survive(store_url, tmp_path):
    """Same bytes in two models (blobs are shared store-wide); deleting one model's releases
    must not take the other's files."""
    _publish_versions(store_url, tmp_path, ["v1"], model="alpha")
    _publish_versions(store_url, tmp_path, ["v1", "v2"], model="beta")  # beta v1 == alpha v1 bytes
    store = open_store(store_url)
    alpha = _needed_blobs(store, "alpha")
    assert alpha & {ref.sha256 for _, ref in read_release(store, "beta", "v1").iter_files()}
    r = gc(store, "beta", keep=1, grace_s=0)
    assert r.deleted_releases == ["v1"]
    assert alpha <= _all_blobs(store)
    assert [m.version for m in list_releases(store, "alpha")] == ["v1"]


def test_unpublished_cache_entries_of_the_model_wait_for_the_grace_period(store_url, tmp_path):
    """compile wrote entries; publish has not run yet: gc leaves them (and their blobs)."""
    cfg = write_release_config(tmp_path, store_url, model="tiny")
    release = load_config(cfg)
    store = open_store(store_url)
    entries = fake_compile(release, store, tmp_path)
    r = gc(store, "tiny", keep=1)
    assert r.deleted_cache_entries == [] and r.deleted_blobs == []
    r = gc(store, "tiny", keep=1, grace_s=0)
    assert sorted(r.deleted_cache_entries) == sorted(e.key for e in entries.values())
    assert _all_blobs(store) == set()


def test_keep_zero_still_keeps_channel_releases(store_url, tmp_path):
    _publish_versions(store_url, tmp_path, ["v1", "v2"])
    store = open_store(store_url)
    promote(store, "tiny", "v1", "prod")
    r = gc(store, "tiny", keep=0, grace_s=0)
    assert r.kept == ["v1"] and r.deleted_releases == ["v2"]
    assert _needed_blobs(store, "tiny") <= _all_blobs(store)


def test_gc_cli(store_url, tmp_path):
    _publish_versions(store_url, tmp_path, ["v1", "v2", "v3"])
    args = ["gc", "tiny", "--keep", "1", "--grace-hours", "0", "--store", store_url]
    r = runner.invoke(app, [*args, "--dry-run"])
    assert r.exit_code == 0 and "would delete 2 releases (v2, v1)" in r.stdout
    r = runner.invoke(app, [*args, "--json"])
    assert json.loads(r.stdout)["deleted_releases"] == ["v2", "v1"]
    r = runner.invoke(app, ["gc", "tiny", "--keep", "-1", "--store", store_url])
    assert r.exit_code == 2


def test_gc_of_a_model_the_store_does_not_hold_deletes_nothing(store_url, tmp_path):
    """A mistyped model name is bad input: it must not go on to sweep orphan blobs."""
    _publish_versions(store_url, tmp_path, ["v1"])
    store = open_store(store_url)
    orphan = tmp_path / "orphan.bin"
    orphan.write_bytes(b"left by an earlier failed publish")
    put_blob(store, orphan, "x")
    before = sorted(store.list(""))
    with pytest.raises(NotFoundError, match="model 'tinny'"):
        gc(store, "tinny", keep=0, grace_s=0)
    r = runner.invoke(
        app, ["gc", "tinny", "--keep", "0", "--grace-hours", "0", "--store", store_url]
    )
    assert r.exit_code == 2 and r.stderr.startswith("error: model 'tinny': has no releases")
    assert sorted(store.list("")) == before


def test_a_release_promoted_during_gc_is_restored(store_url, tmp_path, monkeypatch):
    """gc read the channels, then someone promoted an old release before gc deleted it:
    gc puts the manifest back (blobs are deleted last, so they are still there)."""
    import pipeline.store.gc as gc_mod

    _publish_versions(store_url, tmp_path, ["v1", "v2"])
    store = open_store(store_url)
    real = gc_mod.list_channels
    calls = []

    def channels_then_promote(s, model):
        calls.append(model)
        if len(calls) == 1:
            seen = real(s, model)
            promote(s, "tiny", "v1", "prod")  # lands after gc's first look
            return seen
        return real(s, model)

    monkeypatch.setattr(gc_mod, "list_channels", channels_then_promote)
    r = gc(store, "tiny", keep=1, grace_s=0)
    assert "v1" in r.kept and r.deleted_releases == []
    assert _needed_blobs(store, "tiny") <= _all_blobs(store)
