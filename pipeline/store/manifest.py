"""The release manifest, ``models/<model>/releases/<version>.json``.

What is not in the manifest does not exist: it names every file of every bucket with its
sha256 and size, and every fact a loader needs to decide whether it can run the release.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.contracts.store_layout import release_key
from pipeline.errors import ManifestError, NotFoundError, RuntimeMismatchError
from pipeline.store.base import Store
from pipeline.store.refs import FileRef

# 2: FileRef.part_size and FileRef.parts (per-part sha256, for verified parallel pulls), and
# BucketEntry.weights_key (graphs and prepared weights cached apart: a fine-tune recompiles
# nothing). 3: FileRef.parts_blake3 (each part's BLAKE3, which pull checks: pipeline.store.refs).
# Readers take any schema up to theirs; a newer one is "upgrade inf2-pipeline".
MANIFEST_SCHEMA = 3


class BucketEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: int = Field(gt=0)
    seq: int = Field(gt=0)
    cache_key: str  # the graph key (pipeline.compile.keys)
    # The key of the prepared weights among ``files`` (one for every bucket of a release);
    # None where the graphs' files hold the weights (neuron) or in schema-1 manifests.
    weights_key: str | None = None
    files: list[FileRef]  # the graphs' files, then the prepared weights' files


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Strict: "2" or 2.0 is a wrong type, not a schema this reader may claim to know.
    schema_version: Annotated[int, Field(strict=True, ge=1)] = MANIFEST_SCHEMA
    model: str
    version: str
    created: str  # ISO 8601, UTC
    weights_digest: str  # sha256 over the checkpoint's weight files (see compile.keys)
    backend: str  # neuron | cuda | cpu
    target: dict[str, Any]  # instance_type, tp_degree, gqa_strategy
    dtype: str
    grid: dict[str, list[int]]  # batch_sizes, sequence_lengths
    gqa: dict[str, Any]  # GqaPlan.to_dict()
    versions: dict[str, str]  # torch, transformers, neuronx-cc, inf2-pipeline ...
    flags: list[str]
    auto_cast_type: str
    config: dict[str, Any]  # the source config as written
    files: list[FileRef] = Field(default_factory=list)  # release-wide files (model config.json)
    buckets: dict[str, BucketEntry]  # keyed by Bucket.name

    def iter_files(self) -> Iterator[tuple[str, FileRef]]:
        """Every file of the release as (location, ref): '' for release-wide files, else the
        bucket name. Paths are relative to the release directory's top or bucket directory."""
        for ref in self.files:
            yield "", ref
        for name, bucket in self.buckets.items():
            for ref in bucket.files:
                yield name, ref

    @property
    def total_size(self) -> int:
        return sum(ref.size for _, ref in self.iter_files())

    def content_digest(self) -> str:
        """sha256 over everything but the version and the creation time: two releases with
        the same digest have the same bytes and the same facts."""
        body = self.model_dump(mode="json", exclude={"version", "created"})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def to_bytes(self) -> bytes:
        return self.model_dump_json(indent=2).encode()


def parse_manifest(data: bytes, what: str) -> Manifest:
    """Validate stored manifest bytes: the one manifest reader (store, pull, runtime, parity).

    A newer schema is "upgrade inf2-pipeline"; any other defect is one ``ManifestError``
    line naming the first bad field. Both exit 2: no retry can fix a manifest.
    """
    raw = json_object(data, what, REPUBLISH)
    schema = raw.get("schema_version")
    if isinstance(schema, int) and schema > MANIFEST_SCHEMA:
        raise RuntimeMismatchError(
            what,
            f"manifest schema {schema} is newer than this inf2-pipeline reads ({MANIFEST_SCHEMA})",
            "upgrade inf2-pipeline",
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        raise ManifestError(what, first_problem(e), REPUBLISH) from None


REPUBLISH = "the manifest is malformed; republish the release"


def parse_release(data: bytes, what: str, model: str, version: str) -> Manifest:
    """``parse_manifest`` for the bytes stored under release ``model``/``version``: they
    must name that release (a manifest copied under another name would install or be
    promoted as a release it is not)."""
    manifest = parse_manifest(data, what)
    if (manifest.model, manifest.version) != (model, version):
        raise ManifestError(
            what, f"the manifest names release {manifest.model} {manifest.version}", REPUBLISH
        )
    return manifest


def json_object(data: bytes, what: str, hint: str) -> dict[str, Any]:
    """Stored pointer or manifest bytes as a JSON object; else one ``ManifestError`` line."""
    try:
        raw = json.loads(data)
    except ValueError as e:
        raise ManifestError(what, f"not valid JSON ({e})", hint) from None
    if not isinstance(raw, dict):
        raise ManifestError(what, "not a JSON object", hint)
    return raw


def first_problem(e: ValidationError) -> str:
    """pydantic's first error as 'field F: why' on one line (no URL), plus how many more.
    Field names come from the file: control characters in them are shown escaped."""
    errors = e.errors(include_url=False)
    first = errors[0]
    field = ".".join(str(p) for p in first["loc"]) or "(top level)"
    why = {"missing": "missing", "extra_forbidden": "unknown field"}.get(
        first["type"], str(first["msg"]).splitlines()[0]
    )
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"field '{_printable(field)}': {_printable(why)}{more}"


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# --- reading one from a store (``pipeline.store.releases`` lists and resolves them) ---


def read_release_bytes(store: Store, model: str, version: str) -> tuple[Manifest, bytes]:
    """The manifest and its stored bytes (pull installs them verbatim)."""
    data = read_manifest_bytes(store, model, version)
    what = f"release {model} {version} ({store.url}/{release_key(model, version)})"
    return parse_release(data, what, model, version), data


def read_manifest_bytes(store: Store, model: str, version: str) -> bytes:
    """The stored manifest's bytes, unparsed (pull verifies them before it parses them)."""
    key = release_key(model, version)
    try:
        data = store.get_bytes(key)
    except NotFoundError:
        raise NotFoundError(
            f"release {model} {version}",
            f"not found in {store.url}",
            f"see 'inf2-pipeline list {model} --store {store.url}'",
        ) from None
    return data
