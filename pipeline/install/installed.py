"""The installed release: its on-disk layout, and the one reader and verifier of it.

``pull`` writes it; the runtime, parity and ``serve`` read it only through ``open_installed``,
which parses the manifest through ``parse_manifest`` (a newer schema is "upgrade
inf2-pipeline", any other defect one line naming the field; both exit 2) and checks the files:
``verify="size"`` (cheap, at load time) or ``verify="sha256"`` (pull and parity).

DEST/<model>/<version>/manifest.json          the release manifest, verbatim
DEST/<model>/<version>/signature.json         its signature (pipeline.store.signing), if any
DEST/<model>/<version>/<path>                 release-wide files (e.g. the model config)
DEST/<model>/<version>/buckets/<name>/<path>  each bucket's files
DEST/<model>/current -> <version>             swapped atomically after a complete install
"""

from __future__ import annotations

import contextlib
import zipfile
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from pipeline._files import sha256_file
from pipeline.errors import InputError, IntegrityError, PipelineError
from pipeline.store.manifest import Manifest, parse_manifest
from pipeline.store.refs import FileRef
from pipeline.store.signing import Trust, parse_signature
from pipeline.store.signing import verify as verify_signature

MANIFEST = "manifest.json"
SIGNATURE = "signature.json"  # the manifest's signature, where the release is signed
CURRENT = "current"
BUCKETS = "buckets"
# A file lands as `.<name>.incomplete` beside its final name, then is renamed over it; no
# manifest path may end so (it could be another file's temporary name).
TEMPORARY_SUFFIX = ".incomplete"


def temporary(path: Path) -> Path:
    """``path``'s temporary name while it lands: ``.<name>.incomplete`` beside it."""
    return path.with_name(f".{path.name}{TEMPORARY_SUFFIX}")


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
    if any(ord(c) < 32 or ord(c) == 127 for c in rel) or p.name.endswith(TEMPORARY_SUFFIX):
        raise InputError(
            f"manifest path {rel!r}",
            f"holds a control character or ends in '{TEMPORARY_SUFFIX}' (pull's temporary names)",
            "the manifest is malformed or malicious; republish the release",
        )
    return p


def release_files(manifest: Manifest) -> list[tuple[PurePosixPath, FileRef]]:
    """(relative install path, FileRef) for every file the manifest names, checked for safety."""
    files = [(safe_relpath(ref.path), ref) for ref in manifest.files]
    for name, bucket in sorted(manifest.buckets.items()):
        safe_relpath(name)
        files += [
            (PurePosixPath(BUCKETS, name) / safe_relpath(ref.path), ref) for ref in bucket.files
        ]
    seen: set[PurePosixPath] = set()
    for rel, _ in files:
        if rel in seen or rel in (PurePosixPath(MANIFEST), PurePosixPath(SIGNATURE)):
            raise InputError(
                f"manifest path '{rel}'",
                "appears twice or shadows manifest.json or signature.json",
                "republish the release",
            )
        seen.add(rel)
    folders = {parent for rel in seen for parent in rel.parents}
    for rel in sorted(seen & folders):  # `a` and `a/b`; a top-level file named `buckets`
        raise InputError(
            f"manifest path '{rel}'",
            "is a file and also the folder of another file",
            "republish the release",
        )
    return files


def find_release(path: Path | str) -> Path:
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


Verify = Literal["none", "size", "sha256"]


@dataclass(frozen=True)
class InstalledRelease:
    dir: Path
    manifest: Manifest

    @property
    def what(self) -> str:
        return f"release {self.manifest.model} {self.manifest.version}"

    def bucket_dir(self, name: str) -> Path:
        return self.dir / BUCKETS / name


def read_installed_manifest(release_dir: Path, trust: Trust | None = None) -> Manifest:
    """The manifest of an installed release, through the one manifest parser; with
    ``trust``, refused (``VerificationError``) unless ``signature.json`` beside it is a
    trusted key's signature of its exact bytes."""
    path = Path(release_dir) / MANIFEST
    data = _read(path)
    manifest = parse_manifest(data, str(path))
    if trust is not None:
        sig_path = path.with_name(SIGNATURE)
        sig = parse_signature(_read(sig_path), str(sig_path)) if sig_path.is_file() else None
        verify_signature(sig, manifest.model, manifest.version, data, trust)
    return manifest


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise InputError(str(path), f"unreadable: {e.strerror}", "pull the release again") from None


def open_installed(
    path: Path | str,
    *,
    verify: Verify = "size",
    buckets: Collection[str] | None = None,
    trust: Trust | None = None,
) -> InstalledRelease:
    """``DIR/MODEL`` (following ``current``) or a release directory, its manifest read (and
    its signature checked against ``trust``) and its files checked (every release-wide
    file, and the files of ``buckets``, default all)."""
    release_dir = find_release(path)
    installed = InstalledRelease(release_dir, read_installed_manifest(release_dir, trust))
    if verify != "none":
        verify_files(installed, verify, buckets)
    return installed


def verify_files(
    installed: InstalledRelease, mode: Verify = "sha256", buckets: Collection[str] | None = None
) -> None:
    """Every file the manifest names is there with its size (and with ``sha256``, its digest;
    hard links to one blob are hashed once). One ``IntegrityError`` line for the first bad."""
    hashed: dict[tuple[int, int, int], str] = {}
    for rel, ref in release_files(installed.manifest):
        if buckets is not None and rel.parts[0] == BUCKETS and rel.parts[1] not in buckets:
            continue
        path = installed.dir / rel
        try:
            st = path.stat()
        except OSError:
            st = None
        if st is None or not path.is_file() or st.st_size != ref.size:
            raise IntegrityError(
                str(path),
                "missing or of the wrong size",
                "the install is incomplete; pull the release again",
            )
        if mode != "sha256":
            continue
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if key not in hashed:
            hashed[key] = sha256_file(path)
        if hashed[key] != ref.sha256:
            raise IntegrityError(
                str(path),
                f"sha256 {hashed[key][:12]} differs from the manifest's {ref.sha256[:12]}",
                "the install is damaged; pull the release again",
            )


@contextlib.contextmanager
def reading(installed: InstalledRelease, buckets: Collection[str] | None = None) -> Iterator[None]:
    """Parse the release's files inside this: load time checks sizes only, so a file of the
    right size with wrong bytes first shows as a parser's error (JSON, zip, safetensors).
    On such an error, hash the files read (release-wide, and ``buckets``, default all): a
    damaged one is one ``IntegrityError`` line, "pull the release again"; if all match, the
    error stands."""
    try:
        yield
    except PipelineError:
        raise
    except _parse_errors() as e:
        if type(e).__name__ == "OutOfMemoryError":  # torch's is a RuntimeError
            raise
        verify_files(installed, "sha256", buckets)
        raise


def _parse_errors() -> tuple[type[Exception], ...]:
    """What parsers of the release's files raise on bad bytes: JSON and text decoding
    (ValueError), zip and torch's package readers (BadZipFile, RuntimeError, EOFError),
    safetensors. Not TypeError (a caller's mistake) nor MemoryError."""
    kinds: list[type[Exception]] = [ValueError, RuntimeError, EOFError, zipfile.BadZipFile]
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError

        kinds.append(SafetensorError)
    return tuple(kinds)
