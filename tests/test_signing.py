"""Signed releases: sign at publish, pointer digests at promote, verify at pull, load and
serve; every tampering refused with nothing installed (local store and S3 through moto's
server, whose KMS signs for the KMS signer)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from pipeline.contracts.store_layout import blob_key, channel_key, release_key, signatures_prefix
from pipeline.errors import AlreadyExistsError, IntegrityError, VerificationError
from pipeline.install.installed import open_installed
from pipeline.install.pull import pull_release
from pipeline.store import open_store
from pipeline.store.channels import promote, read_channel
from pipeline.store.gc import gc
from pipeline.store.publish import sign_release
from pipeline.store.signing import (
    KmsSigner,
    PemSigner,
    load_trust,
    manifest_digest,
    read_signature,
    sign_manifest,
    write_keypair,
    write_signature,
)
from pipeline.store.verified import signature_info
from tests.cli_helpers import one_line
from tests.release_factory import make_release


def run_cli(args: list[str]):
    from typer.testing import CliRunner

    from pipeline.cli import app

    return CliRunner().invoke(app, args)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    return {name: write_keypair(tmp_path / f"{name}.pem") for name in ("a", "b")}


def _signed(store, tmp_path: Path, key: Path, version: str, **kw):
    work = tmp_path / f"work-{version}"
    work.mkdir(exist_ok=True)
    manifest = make_release(store, work, version=version, **kw)
    assert sign_release(store, "m", version, PemSigner(key))
    return manifest


def _manifest_bytes(store, version: str) -> bytes:
    return store.get_bytes(release_key("m", version))


def _edit_manifest(store, version: str, edit) -> None:
    raw = json.loads(_manifest_bytes(store, version))
    edit(raw)
    store.put_bytes(release_key("m", version), json.dumps(raw, indent=2).encode())


# --- tamperings of release v2 (prod points at it); v1 is installed and current ----------


def _swap_blob(store, keys) -> None:
    ref = json.loads(_manifest_bytes(store, "v2"))["buckets"]["b1_s32"]["files"][0]
    store.put_bytes(blob_key(ref["sha256"]), os.urandom(ref["size"]))


def _edit_digest(store, keys) -> None:
    def edit(raw):
        files = raw["buckets"]["b1_s32"]["files"]
        files[0]["sha256"], files[1]["sha256"] = files[1]["sha256"], files[0]["sha256"]

    _edit_manifest(store, "v2", edit)


def _edit_flag(store, keys) -> None:
    _edit_manifest(store, "v2", lambda raw: raw["flags"].append("--evil"))


def _add_bucket(store, keys) -> None:
    _edit_manifest(store, "v2", lambda raw: raw["buckets"].update(b4_s32=raw["buckets"]["b1_s32"]))


def _resign_other_key(store, keys) -> None:
    _edit_flag(store, keys)
    sign_release(store, "m", "v2", PemSigner(keys["b"][0]))


def _remove_signature(store, keys) -> None:
    store.delete_many(list(store.list(signatures_prefix("m", "v2"))))


def _alter_signature(store, keys) -> None:
    data = _manifest_bytes(store, "v2")
    sig = read_signature(store, "m", "v2", manifest_digest(data))
    raw = bytearray(base64.b64decode(sig.signature))
    raw[-1] ^= 1
    write_signature(
        store, "m", "v2", sig.model_copy(update={"signature": base64.b64encode(raw).decode()})
    )


def _pointer_to_unsigned(store, keys) -> None:
    make_release(store, _tmp(store), version="v3")
    promote(store, "m", "v3", "prod")


def _pointer_digest(store, keys) -> None:
    raw = json.loads(store.get_bytes(channel_key("m", "prod")))
    raw["manifest_sha256"] = "0" * 64
    store.put_bytes(channel_key("m", "prod"), json.dumps(raw).encode())


def _tmp(store) -> Path:
    path = Path(os.environ["SIGNING_TEST_TMP"]) / "v3"
    path.mkdir(exist_ok=True)
    return path


TAMPERINGS = {
    "blob swapped": (_swap_blob, IntegrityError, "sha256"),
    # by channel, the pointer's digest refuses an edited manifest first; by version, the
    # signature does (test_tampering_is_refused_when_pulled_by_version)
    "manifest digest edited": (_edit_digest, VerificationError, "stored manifest is"),
    "manifest flag edited": (_edit_flag, VerificationError, "stored manifest is"),
    "bucket added": (_add_bucket, VerificationError, "stored manifest is"),
    "signed by another key": (_resign_other_key, VerificationError, "stored manifest is"),
    "signature removed": (_remove_signature, VerificationError, "is not signed"),
    "signature altered": (_alter_signature, VerificationError, "does not verify"),
    "pointer to an unsigned release": (_pointer_to_unsigned, VerificationError, "is not signed"),
    "pointer digest mismatch": (_pointer_digest, VerificationError, "stored manifest is"),
}


@pytest.fixture
def signed_store(store_url: str, tmp_path: Path, keys, monkeypatch):
    monkeypatch.setenv("SIGNING_TEST_TMP", str(tmp_path))
    store = open_store(store_url)
    _signed(store, tmp_path, keys["a"][0], "v1")
    _signed(store, tmp_path, keys["a"][0], "v2")
    promote(store, "m", "v1", "prod")
    return store


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_each_tampering_is_refused_and_nothing_is_installed(
    signed_store, tmp_path: Path, keys, name: str
) -> None:
    trust = load_trust([keys["a"][1]])
    dest = tmp_path / "dest"
    pull_release(signed_store, "m", dest, channel="prod", trust=trust)
    promote(signed_store, "m", "v2", "prod")
    tamper, error, words = TAMPERINGS[name]
    tamper(signed_store, keys)
    with pytest.raises(error, match=words):
        pull_release(signed_store, "m", dest, channel="prod", trust=trust)
    assert os.readlink(dest / "m" / "current") == "v1"
    assert not (dest / "m" / "v2").exists() and not (dest / "m" / "v3").exists()
    if error is VerificationError:  # refused before anything was written
        assert not (dest / "m" / ".staging-v2").exists()


BY_VERSION = {
    "manifest digest edited": "changed after it was signed",
    "manifest flag edited": "changed after it was signed",
    "bucket added": "changed after it was signed",
    "signed by another key": "not trusted",
    "signature removed": "is not signed",
    "signature altered": "does not verify",
}


@pytest.mark.parametrize("name", list(BY_VERSION))
def test_tampering_is_refused_when_pulled_by_version(signed_store, tmp_path, keys, name):
    TAMPERINGS[name][0](signed_store, keys)
    with pytest.raises(VerificationError, match=BY_VERSION[name]):
        pull_release(
            signed_store, "m", tmp_path / "d", version="v2", trust=load_trust([keys["a"][1]])
        )
    assert not (tmp_path / "d").exists()


def test_signed_release_pulls_verified_and_loads_with_trust(signed_store, tmp_path, keys):
    trust = load_trust([keys["a"][1]])
    r = pull_release(signed_store, "m", tmp_path / "d", channel="prod", trust=trust)
    assert r.signature == "verified" and r.signed_by == PemSigner(keys["a"][0]).key_id
    installed = open_installed(tmp_path / "d" / "m", trust=trust)
    assert installed.manifest.version == "v1"
    # the installed manifest edited on disk is refused at load
    path = installed.dir / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"flags": []', b'"flags": ["-O0"]'))
    with pytest.raises(VerificationError, match="does not verify"):
        open_installed(tmp_path / "d" / "m", trust=trust)
    (installed.dir / "signature.json").unlink()
    with pytest.raises(VerificationError, match="is not signed"):
        open_installed(tmp_path / "d" / "m", trust=trust)


def test_unsigned_store_works_without_trust_and_is_refused_with_it(store_url, tmp_path, keys):
    store = open_store(store_url)
    make_release(store, tmp_path)
    promote(store, "m", "v1", "prod")
    r = pull_release(store, "m", tmp_path / "d", channel="prod")
    assert r.signature == "not checked" and r.signed_by is None
    with pytest.raises(VerificationError, match="is not signed"):
        pull_release(store, "m", tmp_path / "e", channel="prod", trust=load_trust([keys["a"][1]]))
    assert not (tmp_path / "e").exists()


def test_promote_records_the_manifest_digest_and_refuses_what_pods_would(signed_store, keys):
    ch = promote(signed_store, "m", "v2", "prod")
    assert ch.manifest_sha256 == manifest_digest(_manifest_bytes(signed_store, "v2"))
    assert read_channel(signed_store, "m", "prod").history[0].manifest_sha256 == ch.manifest_sha256
    _remove_signature(signed_store, keys)
    with pytest.raises(VerificationError, match="is not signed"):
        promote(signed_store, "m", "v2", "staging", trust=load_trust([keys["a"][1]]))


def test_old_pointer_without_digest_is_refused_only_where_a_key_is_trusted(
    signed_store, tmp_path, keys
) -> None:
    signed_store.put_bytes(channel_key("m", "old"), b'{"version": "v1"}')
    pull_release(signed_store, "m", tmp_path / "d", channel="old")
    with pytest.raises(VerificationError, match="re-promote"):
        pull_release(
            signed_store, "m", tmp_path / "e", channel="old", trust=load_trust([keys["a"][1]])
        )


def test_sign_release_is_idempotent_and_keeps_another_keys_signature(signed_store, keys):
    assert not sign_release(signed_store, "m", "v1", PemSigner(keys["a"][0]))
    with pytest.raises(AlreadyExistsError, match="already signed by key"):
        sign_release(signed_store, "m", "v1", PemSigner(keys["b"][0]))
    assert sign_release(signed_store, "m", "v1", PemSigner(keys["b"][0]), replace=True)
    info = signature_info(signed_store, "m", "v1", load_trust([keys["b"][1]]))
    assert info.status == "trusted" and info.key_id == PemSigner(keys["b"][0]).key_id
    assert signature_info(signed_store, "m", "v1", None).status == "untrusted"


def test_gc_deletes_the_signatures_of_deleted_releases(signed_store) -> None:
    gc(signed_store, "m", keep=0, grace_s=0)  # v1 stays: prod points at it
    assert list(signed_store.list(signatures_prefix("m", "v1")))
    assert not list(signed_store.list(signatures_prefix("m", "v2")))


def test_rsa_pss_keys_sign_and_verify(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "rsa.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (tmp_path / "rsa.pub.pem").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    store = open_store(str(tmp_path / "store"))
    _signed(store, tmp_path, tmp_path / "rsa.pem", "v1")
    trust = load_trust([tmp_path / "rsa.pub.pem"])
    assert signature_info(store, "m", "v1", trust).status == "trusted"


def test_trust_refuses_private_keys_and_garbage_and_reads_folders(tmp_path, keys) -> None:
    from pipeline.errors import InputError

    with pytest.raises(InputError, match="is a private key"):
        load_trust([keys["a"][0]])
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(InputError, match="not a PEM public key"):
        load_trust([tmp_path / "junk.pem"])
    folder = tmp_path / "trust"
    folder.mkdir()
    for name in ("a", "b"):
        (folder / f"{name}.pem").write_bytes(keys[name][1].read_bytes())
    assert len(load_trust([folder]).keys) == 2
    assert load_trust([]) is None


def test_statement_binds_the_release_name(tmp_path, keys) -> None:
    """A signature copied from one release to another (same bytes, other version) fails."""
    store = open_store(str(tmp_path / "store"))
    _signed(store, tmp_path, keys["a"][0], "v1")
    data = _manifest_bytes(store, "v1")
    sig = sign_manifest(PemSigner(keys["a"][0]), "m", "v1", data)
    from pipeline.store.signing import check

    assert check(sig, "m", "v1", data, None) == "untrusted"
    assert check(sig, "m", "v9", data, None) == "invalid"
    assert check(sig, "other", "v1", data, None) == "invalid"


# --- KMS (moto's server) ------------------------------------------------------------------


@pytest.mark.s3
@pytest.mark.parametrize("spec", ["ECC_NIST_P256", "RSA_2048"])
def test_kms_signed_release_pulls_with_its_pinned_public_key(
    s3_store_url: str, tmp_path: Path, spec: str
) -> None:
    import boto3

    kms = boto3.client("kms")
    key = kms.create_key(KeySpec=spec, KeyUsage="SIGN_VERIFY")["KeyMetadata"]
    alias = f"alias/release-{key['KeyId'][:8]}"
    kms.create_alias(AliasName=alias, TargetKeyId=key["KeyId"])
    store = open_store(s3_store_url)
    make_release(store, tmp_path)
    signer = KmsSigner(alias)
    sign_release(store, "m", "v1", signer)
    assert signer.signer.startswith("kms:") and key["KeyId"] in signer.signer
    promote(store, "m", "v1", "prod")
    # the pod's pin: the public key fetched once (pubkey), no KMS call at pull
    out = run_cli(["pubkey", f"kms://{alias}", "--out", str(tmp_path / "release.pub.pem")])
    assert out.exit_code == 0, out.output
    r = pull_release(
        store, "m", tmp_path / "d", channel="prod", trust=load_trust([tmp_path / "release.pub.pem"])
    )
    assert r.signature == "verified" and r.signed_by == signer.key_id


@pytest.mark.s3
def test_kms_key_that_does_not_exist_is_one_line(s3_env: str) -> None:
    one_line(run_cli(["pubkey", "kms://alias/no-such-key"]), 2, "no such KMS key")


# --- the command line ---------------------------------------------------------------------


def test_cli_sign_list_diff_pull(tmp_path: Path, keys) -> None:
    store = open_store(str(tmp_path / "store"))
    work = tmp_path / "w"
    work.mkdir()
    make_release(store, work, version="v1")
    make_release(store, work, version="v2")
    s = ["--store", str(tmp_path / "store")]
    out = run_cli(["sign", "m", "v2", "--key", str(keys["a"][0]), *s])
    assert out.exit_code == 0 and "signed: m v2 by key" in out.output
    assert run_cli(["promote", "m", "v2", "--channel", "prod", *s]).exit_code == 0
    out = run_cli(["list", "m", *s, "--trust", str(keys["a"][1])])
    kid = PemSigner(keys["a"][0]).key_id[:16]
    assert f"{kid} (trusted)" in out.output and "unsigned" in out.output
    out = run_cli(["diff", "m", "v1", "v2", *s])
    assert f"signed by: unsigned → {kid} (untrusted)" in out.output
    assert "signer changed" in out.output
    out = run_cli(["pull", "m", "--channel", "prod", "--dest", str(tmp_path / "d"), *s,
                   "--trust", str(keys["b"][1])])  # fmt: skip
    one_line(out, 2, "not trusted", "release m v2")
    out = run_cli(["pull", "m", "--channel", "prod", "--dest", str(tmp_path / "d"), *s,
                   "--trust", str(keys["a"][1])])  # fmt: skip
    assert out.exit_code == 0 and f"signed by key {kid}" in out.output
    out = run_cli(["pull", "m", "--version", "v1", "--dest", str(tmp_path / "e"), *s])
    assert out.exit_code == 0 and "not verifying signatures" in out.output


def test_load_and_serve_refuse_an_unsigned_install_where_a_key_is_trusted(installed, keys):
    _, installed = installed
    """``installed``: a real compiled cpu release, pulled unsigned."""
    from pipeline.runtime import BucketedModel

    with pytest.raises(VerificationError, match="is not signed"):
        BucketedModel.load(installed, trust=load_trust([keys["a"][1]]))
    # before binding a port or loading anything
    out = run_cli(["serve", str(installed), "--port", "0", "--trust", str(keys["a"][1])])
    one_line(out, 2, "is not signed")


def test_kms_errors_speak_of_kms_and_name_the_permission() -> None:
    from pipeline.errors import StoreError
    from pipeline.store.signing import _kms_error

    e = _kms_error(StoreError("KMS key k", "S3 error AccessDeniedException: no", "retry later"))
    assert e.why == "KMS error AccessDeniedException: no" and "kms:Sign" in e.hint
    assert isinstance(e, StoreError)
