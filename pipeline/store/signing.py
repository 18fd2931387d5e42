"""Signed releases: a signature over each manifest's exact bytes, made by the release job's
key, checked by every pod against a public key it trusts (docs/store.md, "Signed releases").

What is signed is a short statement naming the release and the sha256 of its manifest's
bytes (which name every file's sha256): ``{"manifest_sha256", "model", "type", "version"}``
as compact, key-sorted JSON. It is under KMS's 4,096-byte limit for a RAW message, so KMS
and a local key sign the same bytes the same way, and the type string keeps it from
verifying as anything else. The envelope (``Signature``) is stored at
``models/<m>/signatures/<v>/<manifest sha256>.json`` and installed as ``signature.json``.

Two signers, one interface: a KMS asymmetric key (ECC_NIST_P256 with ECDSA_SHA_256, or RSA
with RSASSA_PSS_SHA_256; the private key never leaves KMS) and a PEM private key file. A
key's id is the sha256 of its public key (DER SubjectPublicKeyInfo), so a pod pins keys by
their public half alone and needs no KMS call to verify.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.contracts.store_layout import signature_key, signatures_prefix
from pipeline.errors import (
    InputError,
    ManifestError,
    NotFoundError,
    PipelineError,
    VerificationError,
)
from pipeline.store.base import Store
from pipeline.store.manifest import first_problem, json_object

SIGNATURE_SCHEMA = 1
STATEMENT_TYPE = "inf2-pipeline/release-signature/v1"
SIGNATURE_FILE = "signature.json"  # beside manifest.json in an installed release
PASSWORD_ENV = "INF2_PIPELINE_SIGNING_KEY_PASSWORD"  # for an encrypted PEM private key
Algorithm = Literal["ecdsa-p256-sha256", "rsa-pss-sha256"]
# KMS names (AWS KMS developer guide, "Key spec reference": signing algorithms)
KMS_ALGORITHM = {"ecdsa-p256-sha256": "ECDSA_SHA_256", "rsa-pss-sha256": "RSASSA_PSS_SHA_256"}
KMS_HINT = "sign with kms://alias/NAME, a KMS key ARN, or a PEM private key file"


class Signature(BaseModel):
    """The stored envelope. Only ``algorithm``, ``key_id`` and ``signature`` are used to
    verify, against a trusted key; the rest is for people (``list``, ``show``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SIGNATURE_SCHEMA
    algorithm: Algorithm
    key_id: str  # sha256 hex of the public key's DER SubjectPublicKeyInfo
    signature: str  # base64
    manifest_sha256: str
    signer: str  # where it was made: "kms:<key ARN>" or "pem"
    signed_at: str
    public_key: str  # PEM; shown, never trusted

    @property
    def short_id(self) -> str:
        return self.key_id[:16]


def manifest_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def statement(model: str, version: str, manifest_sha256: str) -> bytes:
    body = {
        "manifest_sha256": manifest_sha256,
        "model": model,
        "type": STATEMENT_TYPE,
        "version": version,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# --- keys ---------------------------------------------------------------------------------


def key_id(public_key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def public_pem(public_key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def algorithm_of(public_key: Any, what: str) -> Algorithm:
    """The one algorithm each supported key type signs with; other keys are refused."""
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    if isinstance(public_key, ec.EllipticCurvePublicKey) and public_key.curve.name == "secp256r1":
        return "ecdsa-p256-sha256"
    if isinstance(public_key, rsa.RSAPublicKey) and public_key.key_size >= 2048:
        return "rsa-pss-sha256"
    raise InputError(what, "not an ECDSA P-256 or RSA (2048 bits or more) key", KMS_HINT)


def _verify_raw(public_key: Any, algorithm: Algorithm, signature: bytes, data: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, padding

    try:
        if algorithm == "ecdsa-p256-sha256":
            public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        else:
            # AUTO: the salt length is read from the signature. KMS's RSASSA_PSS_SHA_256
            # salts with the digest length (32 bytes), as PemSigner does.
            pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.AUTO)
            public_key.verify(signature, data, pss, hashes.SHA256())
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


class Signer(Protocol):
    key_id: str
    algorithm: Algorithm
    signer: str  # as recorded in the envelope
    public_key: Any  # cryptography's public key object

    def sign(self, data: bytes) -> bytes: ...


class PemSigner:
    """A private key in a PEM file (the embedded default, tests, air-gapped releases)."""

    signer = "pem"

    def __init__(self, path: Path) -> None:
        from cryptography.hazmat.primitives import serialization

        what = f"signing key {path}"
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise InputError(what, f"unreadable: {e.strerror}", KMS_HINT) from None
        password = os.environ.get(PASSWORD_ENV)
        try:
            self._key = serialization.load_pem_private_key(
                data, password.encode() if password else None
            )
        except TypeError:  # encrypted and no password, or a password and not encrypted
            raise InputError(
                what, "encrypted, or not encrypted with a password given", f"set {PASSWORD_ENV}"
            ) from None
        except ValueError:
            raise InputError(
                what, "not a PEM private key (or a wrong password)", KMS_HINT
            ) from None
        self.public_key = self._key.public_key()
        self.algorithm = algorithm_of(self.public_key, what)
        self.key_id = key_id(self.public_key)

    def sign(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec, padding

        if self.algorithm == "ecdsa-p256-sha256":
            return self._key.sign(data, ec.ECDSA(hashes.SHA256()))
        pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)
        return self._key.sign(data, pss, hashes.SHA256())


class KmsSigner:
    """An AWS KMS asymmetric key (KeyUsage SIGN_VERIFY): ``kms.sign`` on the statement, so
    the private key never leaves KMS. The public key is fetched once, at construction."""

    def __init__(self, key: str, client: Any = None) -> None:
        from cryptography.hazmat.primitives import serialization

        from pipeline.store.s3_client import make_client
        from pipeline.store.s3_errors import translate_error

        self._key = key
        self._what = f"KMS key {key}"
        self._client = client or make_client("kms")
        try:
            got = self._client.get_public_key(KeyId=key)
        except Exception as e:
            raise _kms_error(translate_error(e, self._what)) from None
        if got.get("KeyUsage", "SIGN_VERIFY") != "SIGN_VERIFY":
            raise InputError(
                self._what, f"its KeyUsage is {got['KeyUsage']}", "use a SIGN_VERIFY key"
            )
        self.public_key = serialization.load_der_public_key(got["PublicKey"])
        self.algorithm = algorithm_of(self.public_key, self._what)
        if KMS_ALGORITHM[self.algorithm] not in got.get("SigningAlgorithms", []):
            raise InputError(
                self._what, f"cannot sign with {KMS_ALGORITHM[self.algorithm]}", KMS_HINT
            )
        self.key_id = key_id(self.public_key)
        self.signer = f"kms:{got.get('KeyId', key)}"

    def sign(self, data: bytes) -> bytes:
        from pipeline.store.s3_errors import translate_error

        try:
            got = self._client.sign(
                KeyId=self._key,
                Message=data,
                MessageType="RAW",
                SigningAlgorithm=KMS_ALGORITHM[self.algorithm],
            )
        except Exception as e:
            raise _kms_error(translate_error(e, self._what)) from None
        self.signer = f"kms:{got.get('KeyId', self._key)}"  # KMS answers with the key's ARN
        return got["Signature"]


def _kms_error(e: Exception) -> Exception:
    """translate_error speaks of S3; a missing KMS key or alias is bad input (exit 2)."""
    if isinstance(e, NotFoundError) or "NotFoundException" in str(e):
        return InputError(e.what, "no such KMS key or alias in this account and region", KMS_HINT)
    if not isinstance(e, PipelineError):
        return e
    why = e.why.replace("S3 error", "KMS error")
    if "access denied" in why or "AccessDenied" in why:
        return type(e)(e.what, why, "the role needs kms:GetPublicKey and kms:Sign on this key")
    return type(e)(e.what, why, e.hint)


def open_signer(spec: str) -> Signer:
    """``kms://alias/NAME`` (or ``kms://KEY-ID``), a KMS key ARN, or a PEM private key file."""
    if spec.startswith("kms://"):
        return KmsSigner(spec[len("kms://") :])
    if spec.startswith("arn:") and ":kms:" in spec:
        return KmsSigner(spec)
    return PemSigner(Path(spec))


def sign_manifest(signer: Signer, model: str, version: str, data: bytes) -> Signature:
    digest = manifest_digest(data)
    raw = signer.sign(statement(model, version, digest))
    return Signature(
        algorithm=signer.algorithm,
        key_id=signer.key_id,
        signature=base64.b64encode(raw).decode(),
        manifest_sha256=digest,
        signer=signer.signer,
        signed_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        public_key=public_pem(signer.public_key),
    )


def write_keypair(path: Path, *, overwrite: bool = False) -> tuple[Path, Path]:
    """A new ECDSA P-256 private key at ``path`` (mode 0600) and its public key beside it
    (``NAME.pub.pem``), each written under a temporary name, then renamed."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from pipeline._files import atomic_write_bytes

    public = path.with_name(path.name.removesuffix(".pem") + ".pub.pem")
    for p in (path, public):
        if p.exists() and not overwrite:
            raise InputError(str(p), "already exists", "pass --overwrite to replace the key pair")
    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    atomic_write_bytes(path, private, mode=0o600)
    atomic_write_bytes(public, public_pem(key.public_key()).encode())
    return path, public


# --- trust --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trust:
    """The public keys a pod or a user trusts, by key id."""

    keys: dict[str, Any]

    def describe(self) -> str:
        return ", ".join(k[:16] for k in sorted(self.keys))


def load_trust(paths: Sequence[Path] | None) -> Trust | None:
    """PEM public key files, or folders of ``*.pem`` files (a mounted ConfigMap: several
    keys while one is rotated out). None when no path is given: nothing is verified."""
    if not paths:
        return None
    from cryptography.hazmat.primitives import serialization

    keys: dict[str, Any] = {}
    for path in paths:
        path = Path(path)
        files = sorted(path.glob("*.pem")) if path.is_dir() else [path]
        if not files:
            raise InputError(f"--trust {path}", "a folder with no .pem file", "add the public key")
        for file in files:
            what = f"--trust {file}"
            try:
                data = file.read_bytes()
            except OSError as e:
                raise InputError(
                    what, f"unreadable: {e.strerror}", "pass a public key file"
                ) from None
            if b"PRIVATE KEY" in data:
                raise InputError(
                    what,
                    "is a private key: a pod needs only the public key",
                    "pass its public key ('inf2-pipeline pubkey KEY' prints it)",
                )
            try:
                key = serialization.load_pem_public_key(data)
            except ValueError:
                raise InputError(
                    what, "not a PEM public key", "'inf2-pipeline pubkey KEY' prints one"
                ) from None
            algorithm_of(key, what)
            keys[key_id(key)] = key
    return Trust(keys)


def parse_signature(data: bytes, what: str) -> Signature:
    hint = "re-sign the release: 'inf2-pipeline sign MODEL VERSION --key KEY'"
    raw = json_object(data, what, hint)
    try:
        return Signature.model_validate(raw)
    except ValidationError as e:
        raise ManifestError(what, first_problem(e), hint) from None


Status = Literal["trusted", "untrusted", "invalid", "unsigned"]


def check(
    sig: Signature | None, model: str, version: str, data: bytes, trust: Trust | None
) -> Status:
    """What ``list``/``show``/``diff`` print: a trusted key's valid signature; a valid one by
    a key not trusted (or none configured: checked against the envelope's own public key,
    which shows only that it was not altered since it was made); an invalid one; none."""
    if sig is None:
        return "unsigned"
    if trust is not None and sig.key_id in trust.keys:
        key = trust.keys[sig.key_id]
        return "trusted" if _valid(sig, key, model, version, data) else "invalid"
    try:
        from cryptography.hazmat.primitives import serialization

        own = serialization.load_pem_public_key(sig.public_key.encode())
    except ValueError:
        return "invalid"
    if key_id(own) != sig.key_id or not _valid(sig, own, model, version, data):
        return "invalid"
    return "untrusted"


def _valid(sig: Signature, key: Any, model: str, version: str, data: bytes) -> bool:
    digest = manifest_digest(data)
    try:
        raw = base64.b64decode(sig.signature, validate=True)
    except ValueError:
        return False
    return (
        sig.manifest_sha256 == digest
        and algorithm_of(key, "trusted key") == sig.algorithm
        and _verify_raw(key, sig.algorithm, raw, statement(model, version, digest))
    )


def verify(
    sig: Signature | None,
    model: str,
    version: str,
    data: bytes,
    trust: Trust,
    *,
    others: Sequence[Signature] = (),
) -> Signature:
    """The signature of these manifest bytes by a trusted key, or one ``VerificationError``
    line naming what failed, the release and the key. ``others``: signatures stored for
    other bytes of this release (they tell an edited manifest from an unsigned one)."""
    what = f"release {model} {version} (manifest sha256 {manifest_digest(data)[:16]})"
    fix = "pull a release signed by a trusted key, or re-sign this one"
    if sig is None:
        if others:
            keys = ", ".join(sorted({s.short_id for s in others}))
            raise VerificationError(
                what,
                f"the manifest was changed after it was signed (key {keys} signed other bytes)",
                "republish the release; do not edit a published manifest",
            )
        raise VerificationError(what, f"is not signed (trusted keys: {trust.describe()})", fix)
    if sig.key_id not in trust.keys:
        raise VerificationError(
            what,
            f"signed by key {sig.short_id}, which is not trusted (trusted: {trust.describe()})",
            "pass that key's public key to --trust if it is yours",
        )
    if not _valid(sig, trust.keys[sig.key_id], model, version, data):
        raise VerificationError(
            what,
            f"the signature by key {sig.short_id} does not verify",
            "the manifest or its signature was altered; republish and re-sign",
        )
    return sig


# --- in a store ---------------------------------------------------------------------------


def read_signature(store: Store, model: str, version: str, digest: str) -> Signature | None:
    key = signature_key(model, version, digest)
    try:
        data = store.get_bytes(key)
    except NotFoundError:
        return None
    return parse_signature(data, f"signature of release {model} {version} ({store.url}/{key})")


def other_signatures(store: Store, model: str, version: str, digest: str) -> list[Signature]:
    """Signatures stored for other manifest bytes of the release (read on a failure only)."""
    out = []
    for key in store.list(signatures_prefix(model, version)):
        if not key.endswith(f"/{digest}.json"):
            try:
                out.append(parse_signature(store.get_bytes(key), key))
            except (ManifestError, NotFoundError):
                continue
    return out


def write_signature(store: Store, model: str, version: str, sig: Signature) -> None:
    key = signature_key(model, version, sig.manifest_sha256)
    store.put_bytes(key, sig.model_dump_json(indent=2).encode())


def verify_in_store(store: Store, model: str, version: str, data: bytes, trust: Trust) -> Signature:
    """``verify`` for manifest bytes read from ``store``."""
    digest = manifest_digest(data)
    sig = read_signature(store, model, version, digest)
    others = other_signatures(store, model, version, digest) if sig is None else []
    return verify(sig, model, version, data, trust, others=others)
