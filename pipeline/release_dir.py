"""The on-disk layout of an installed release, written by ``pull`` and read by the runtime.

DEST/<model>/<version>/manifest.json          the release manifest, verbatim
DEST/<model>/<version>/<path>                 release-wide files (e.g. the model config)
DEST/<model>/<version>/buckets/<name>/<path>  each bucket's files
DEST/<model>/current -> <version>             swapped atomically after a complete install
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from pipeline.errors import InputError

MANIFEST = "manifest.json"
CURRENT = "current"
BUCKETS = "buckets"


def safe_relpath(rel: str) -> PurePosixPath:
    """A manifest path as a relative path that cannot leave its directory."""
    p = PurePosixPath(rel)
    if (
        not rel
        or p.is_absolute()
        or rel.startswith(("/", "\\"))
        or "\\" in rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
    ):
        raise InputError(
            f"manifest path '{rel}'",
            "points outside the release directory",
            "the manifest is malformed or malicious; republish the release",
        )
    return p


def release_files(manifest) -> list[tuple[PurePosixPath, object]]:
    """(relative install path, FileRef) for every file the manifest names, checked for safety."""
    files = [(safe_relpath(ref.path), ref) for ref in manifest.files]
    for name, bucket in sorted(manifest.buckets.items()):
        safe_relpath(name)
        files += [
            (PurePosixPath(BUCKETS, name) / safe_relpath(ref.path), ref) for ref in bucket.files
        ]
    seen: set[PurePosixPath] = set()
    for rel, _ in files:
        if rel in seen or rel == PurePosixPath(MANIFEST):
            raise InputError(
                f"manifest path '{rel}'",
                "appears twice or shadows manifest.json",
                "republish the release",
            )
        seen.add(rel)
    return files


def resolve_release(path: Path) -> Path:
    """``DIR/MODEL`` (following ``current``) or a release directory → the release directory."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if (path / CURRENT / MANIFEST).is_file():
        return (path / CURRENT).resolve()
    raise InputError(
        str(path),
        "no release here (no manifest.json, no current/manifest.json)",
        "pass DEST/MODEL after 'inf2-pipeline pull', or a release directory",
    )
