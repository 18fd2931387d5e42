"""Channels, list, show and diff — library and CLI — on both stores."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.compile.release import publish_release
from pipeline.contracts.store_layout import channel_key, release_key
from pipeline.errors import ManifestError, NotFoundError
from pipeline.plan.config import load_config
from pipeline.store import open_store
from pipeline.store.channels import promote, read_channel
from pipeline.store.diff import diff_releases
from pipeline.store.releases import list_models, list_releases, read_release, resolve_release
from tests.store_helpers import (
    bucket_files,
    fake_compile,
    fake_key,
    race,
    write_release_config,
)

runner = CliRunner()


@pytest.fixture
def published(store_url, tmp_path):
    """Model 'tiny' with releases v1 and v2 (v2 recompiled one bucket and added -O2)."""
    cfg = write_release_config(tmp_path / "one", store_url)
    release = load_config(cfg)
    store = open_store(store_url)
    fake_compile(release, store, tmp_path / "one")
    publish_release(release, version="v1", key_fn=fake_key)
    cfg2 = write_release_config(
        tmp_path / "two", store_url, flags="-O2", batch_sizes=(1, 4), sequence_lengths=(32, 64)
    )
    release2 = load_config(cfg2)
    fake_compile(
        release2,
        store,
        tmp_path / "two",
        files=lambda b: bucket_files(b, "new") if b.name == "b1_s64" else bucket_files(b),
    )
    publish_release(release2, version="v2", key_fn=fake_key)
    return store


def _cli(store, *args):
    return runner.invoke(app, [*map(str, args), "--store", store.url])


def test_promote_records_who_when_and_the_previous_version(published):
    first = promote(published, "tiny", "v1", "prod", by="alice@ci")
    assert (first.version, first.previous, first.by) == ("v1", None, "alice@ci")
    second = promote(published, "tiny", "v2", "prod", by="bob@laptop")
    assert (second.version, second.previous, second.by) == ("v2", "v1", "bob@laptop")
    assert second.at.endswith("+00:00")
    stored = read_channel(published, "tiny", "prod")
    assert stored.version == "v2" and [m.version for m in stored.history] == ["v2", "v1"]
    # What pull reads: a plain pointer with a version.
    assert json.loads(published.get_bytes(channel_key("tiny", "prod")))["version"] == "v2"


def test_promote_refuses_a_version_that_does_not_exist(published):
    with pytest.raises(NotFoundError, match="release tiny v9"):
        promote(published, "tiny", "v9", "prod")
    assert read_channel(published, "tiny", "prod") is None
    r = _cli(published, "promote", "tiny", "v9", "--channel", "prod")
    assert r.exit_code == 2 and r.stderr.startswith("error: release tiny v9: not found")


@pytest.mark.parametrize(
    "stored",
    [b"{not json", b'{"schema_version": 1}', "copy of v2"],
    ids=["not-json", "missing-fields", "names-another-release"],
)
def test_promote_refuses_a_release_whose_manifest_does_not_read(published, stored):
    """A channel must never point at a release no pod can pull."""
    key = release_key("tiny", "v1")
    if stored == "copy of v2":
        stored = published.get_bytes(release_key("tiny", "v2"))
    published.delete_many([key])
    published.put_bytes(key, stored)
    with pytest.raises(ManifestError, match="release tiny v1"):
        promote(published, "tiny", "v1", "prod")
    assert read_channel(published, "tiny", "prod") is None
    r = _cli(published, "promote", "tiny", "v1", "--channel", "prod")
    assert r.exit_code == 2 and r.stderr.startswith("error: release tiny v1 (")
    assert "republish" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_concurrent_promotes_serialise_through_compare_and_swap(published):
    """Eight promoters race: every move lands, one after another, none is lost."""
    promote(published, "tiny", "v1", "prod", by="seed")
    stores = [open_store(published.url) for _ in range(8)]
    results, errors = race(
        8, lambda i: promote(stores[i], "tiny", "v2" if i % 2 else "v1", "prod", by=f"p{i}")
    )
    assert len(results) == 8, errors
    ch = read_channel(published, "tiny", "prod")
    assert sorted(m.by for m in ch.history[:8]) == [f"p{i}" for i in range(8)]
    # Each move's "previous" is the version the move before it set: a chain, no gaps.
    for newer, older in zip(ch.history, ch.history[1:], strict=False):
        assert newer.previous == older.version


def test_promote_cli_moves_the_pointer(published):
    r = _cli(published, "promote", "tiny", "v1", "--channel", "staging")
    assert r.exit_code == 0 and "tiny staging: (new) → v1" in r.stdout
    r = _cli(published, "promote", "tiny", "v2", "--channel", "staging", "--json")
    data = json.loads(r.stdout)
    assert (data["version"], data["previous"], data["channel"]) == ("v2", "v1", "staging")
    assert data["by"]


def test_list_models_and_releases_newest_first(published):
    promote(published, "tiny", "v1", "prod")
    assert list_models(published) == ["tiny"]
    assert [m.version for m in list_releases(published, "tiny")] == ["v2", "v1"]
    r = _cli(published, "list", "--json")
    assert json.loads(r.stdout) == [
        {"model": "tiny", "releases": 2, "latest": "v2", "channels": {"prod": "v1"}}
    ]
    r = _cli(published, "list", "tiny", "--json")
    rows = json.loads(r.stdout)
    assert [(x["version"], x["buckets"], x["channels"]) for x in rows] == [
        ("v2", 4, []),
        ("v1", 4, ["prod"]),
    ]
    r = _cli(published, "list", "tiny")
    assert r.exit_code == 0 and r.stdout.splitlines()[2].startswith("v1 ")
    assert r.stdout.splitlines()[2].endswith("prod")


def test_list_of_an_empty_store_says_so(tmp_path):
    r = runner.invoke(app, ["list", "--store", str(tmp_path / "empty")])
    assert r.exit_code == 0 and "no releases" in r.stdout


def test_show_by_version_or_channel(published):
    promote(published, "tiny", "v2", "prod")
    assert resolve_release(published, "tiny", channel="prod").version == "v2"
    r = _cli(published, "show", "tiny", "--channel", "prod", "--json")
    data = json.loads(r.stdout)
    assert data["manifest"]["version"] == "v2" and data["channels"] == ["prod"]
    assert data["content_digest"] == read_release(published, "tiny", "v2").content_digest()
    r = _cli(published, "show", "tiny", "v1")
    assert r.exit_code == 0 and r.stdout.startswith("tiny v1 (no channel)")
    assert "b2_s64" in r.stdout and "release files: config.json" in r.stdout


def test_show_errors_are_one_line(published):
    r = _cli(published, "show", "tiny", "--channel", "canary")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: channel 'canary' of model 'tiny': not found")
    r = _cli(published, "show", "tiny")
    assert r.exit_code == 2 and "exactly one of VERSION or --channel" in r.stderr
    r = _cli(published, "show", "tiny", "v1", "--channel", "prod")
    assert r.exit_code == 2


def test_diff_names_buckets_files_and_fact_changes(published):
    d = diff_releases(read_release(published, "tiny", "v1"), read_release(published, "tiny", "v2"))
    assert d.buckets_added == ["b4_s32", "b4_s64"]
    assert d.buckets_removed == ["b2_s32", "b2_s64"]
    assert list(d.buckets_changed) == ["b1_s64"]
    assert d.buckets_changed["b1_s64"].changed == ["compile.log", "decode.pt2", "prefill.pt2"]
    assert d.buckets_unchanged == 1  # b1_s32
    assert d.facts["flags"] == {"a": [], "b": ["-O2"]}
    assert d.facts["grid.batch_sizes"] == {"a": [1, 2], "b": [1, 4]}
    assert "backend" not in d.facts and not d.files and not d.identical
    r = _cli(published, "diff", "tiny", "v1", "v2")
    assert r.exit_code == 0
    assert "flags: [] → ['-O2']" in r.stdout
    assert "buckets added: b4_s32, b4_s64" in r.stdout
    assert "bucket b1_s64: changed compile.log, decode.pt2, prefill.pt2" in r.stdout
    data = json.loads(_cli(published, "diff", "tiny", "v1", "v2", "--json").stdout)
    assert data["buckets_removed"] == ["b2_s32", "b2_s64"] and data["identical"] is False


def test_diff_of_a_compiler_version_change(published):
    v1 = read_release(published, "tiny", "v1")
    newer = v1.model_copy(update={"versions": {**v1.versions, "neuronx-cc": "2.16"}})
    d = diff_releases(v1, newer)
    assert d.facts == {"versions.neuronx-cc": {"a": None, "b": "2.16"}}
    assert diff_releases(v1, v1).identical
