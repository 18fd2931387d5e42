"""``diff``: what changed between two releases of a model.

Buckets added, removed and changed (with their files added, removed and changed by
digest), release-wide files, and every changed fact: backend, compiler and runtime
versions, flags, target, grid, GQA plan, weights, source config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.store.manifest import Manifest
from pipeline.store.refs import FileRef

# Facts compared key by key (nested dicts flattened to dotted names).
FACTS = (
    "weights_digest",
    "backend",
    "dtype",
    "auto_cast_type",
    "flags",
    "versions",
    "target",
    "grid",
    "gqa",
    "config",
)


@dataclass
class FilesDiff:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


@dataclass
class ReleaseDiff:
    model: str
    a: str
    b: str
    buckets_added: list[str]
    buckets_removed: list[str]
    buckets_changed: dict[str, FilesDiff]
    buckets_unchanged: int
    files: FilesDiff  # release-wide files
    facts: dict[str, dict[str, Any]]  # dotted name -> {"a": old, "b": new}
    bytes_a: int
    bytes_b: int

    @property
    def identical(self) -> bool:
        return not (
            self.buckets_added
            or self.buckets_removed
            or self.buckets_changed
            or self.files
            or self.facts
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "identical": self.identical}


def diff_releases(a: Manifest, b: Manifest) -> ReleaseDiff:
    changed = {
        name: d
        for name in sorted(a.buckets.keys() & b.buckets.keys())
        if (d := diff_files(a.buckets[name].files, b.buckets[name].files))
    }
    facts: dict[str, dict[str, Any]] = {}
    for name in FACTS:
        old, new = _flatten(name, getattr(a, name)), _flatten(name, getattr(b, name))
        for key in sorted(old.keys() | new.keys()):
            if old.get(key) != new.get(key):
                facts[key] = {"a": old.get(key), "b": new.get(key)}
    common = a.buckets.keys() & b.buckets.keys()
    return ReleaseDiff(
        model=b.model,
        a=a.version,
        b=b.version,
        buckets_added=sorted(b.buckets.keys() - a.buckets.keys(), key=_bucket_order),
        buckets_removed=sorted(a.buckets.keys() - b.buckets.keys(), key=_bucket_order),
        buckets_changed=dict(sorted(changed.items(), key=lambda kv: _bucket_order(kv[0]))),
        buckets_unchanged=len(common) - len(changed),
        files=diff_files(a.files, b.files),
        facts=facts,
        bytes_a=a.total_size,
        bytes_b=b.total_size,
    )


def diff_files(a: list[FileRef], b: list[FileRef]) -> FilesDiff:
    old = {f.path: f.sha256 for f in a}
    new = {f.path: f.sha256 for f in b}
    return FilesDiff(
        added=sorted(new.keys() - old.keys()),
        removed=sorted(old.keys() - new.keys()),
        changed=sorted(p for p in old.keys() & new.keys() if old[p] != new[p]),
    )


def _flatten(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(f"{prefix}.{k}", v))
        return out
    return {prefix: value}


def _bucket_order(name: str) -> tuple[int, int, str]:
    try:
        b, s = name.split("_")
        return int(b[1:]), int(s[1:]), name
    except ValueError:
        return 0, 0, name
