"""``pull``: install a release from the store for the EKS init-container.

manifest → parallel ranged GETs → sha256 verified while streaming → atomic install.

Files are fetched into ``DEST/<model>/.staging-<version>/`` (a stable name, so a restarted
init container resumes: files already there and verified are kept), the staging directory is
renamed to ``DEST/<model>/<version>`` only when every file is verified, and then the
``current`` symlink is swapped atomically. A failure at any point leaves the previous install
and ``current`` untouched. This module imports no torch: it must start fast in a slim image.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline._files import sha256_file
from pipeline._progress import ByteProgress, byte_progress
from pipeline.errors import IntegrityError, PipelineError, StoreError
from pipeline.install.installed import CURRENT, MANIFEST, release_files
from pipeline.store.base import Store
from pipeline.store.blobs import FileRef
from pipeline.store.layout import blob_key
from pipeline.store.releases import read_release_bytes, resolve_version

DEFAULT_CHUNK = 16 << 20  # per ranged GET: large enough to amortise a request, small to parallelise
RETRIES = 6


@dataclass(frozen=True)
class PullResult:
    model: str
    version: str
    path: Path
    files: int
    downloaded_bytes: int
    reused_bytes: int
    seconds: float
    already_installed: bool

    def to_dict(self) -> dict:
        return {**self.__dict__, "path": str(self.path)}


def pull_release(
    store: Store,
    model: str,
    dest: Path,
    *,
    version: str | None = None,
    channel: str | None = None,
    concurrency: int = 16,
    chunk_size: int = DEFAULT_CHUNK,
) -> PullResult:
    start = time.monotonic()
    version = resolve_version(store, model, version, channel)
    manifest, raw = read_release_bytes(store, model, version)
    files = release_files(manifest)  # refuses paths that leave the release directory
    model_dir = Path(dest) / model
    final = model_dir / version
    total = sum(ref.size for _, ref in files)
    if (final / MANIFEST).is_file() and (final / MANIFEST).read_bytes() == raw:
        _point_current(model_dir, version)
        return PullResult(
            model, version, final, len(files), 0, total, time.monotonic() - start, True
        )

    staging = model_dir / f".staging-{version}"
    staging.mkdir(parents=True, exist_ok=True)
    # The same bytes under several paths (each bucket's weights.safetensors) download once.
    have: dict[str, Path] = {}
    fetching: set[str] = set()
    fetch, copies = [], []
    for rel, ref in files:
        target = staging / rel
        if _verified(target, ref):
            have.setdefault(ref.sha256, target)
        elif ref.sha256 in have or ref.sha256 in fetching:
            copies.append((target, ref))
        else:
            fetch.append((target, ref))
            fetching.add(ref.sha256)
    reused = total - sum(ref.size for _, ref in fetch)
    fetcher = _Fetcher(store, concurrency, chunk_size)
    with byte_progress(f"pull {model} {version}", total) as progress:
        progress.advance(reused)
        fetcher.fetch_all(fetch, progress)
    have.update({ref.sha256: target for target, ref in fetch})
    for target, ref in copies:
        _link_or_copy(have[ref.sha256], target)
    (staging / MANIFEST).write_bytes(raw)
    if final.exists():  # an earlier, different install under the same version name
        shutil.rmtree(final)
    os.rename(staging, final)
    _point_current(model_dir, version)
    return PullResult(
        model,
        version,
        final,
        len(files),
        fetcher.downloaded,
        reused,
        time.monotonic() - start,
        False,
    )


def _verified(path: Path, ref: FileRef) -> bool:
    try:
        return path.stat().st_size == ref.size and sha256_file(path) == ref.sha256
    except FileNotFoundError:
        return False


def _link_or_copy(src: Path, dest: Path) -> None:
    """A hard link where the filesystem allows (no extra disk), else a copy; atomic."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.incomplete")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def _point_current(model_dir: Path, version: str) -> None:
    """Swap ``current`` to ``version`` atomically (a new symlink renamed over the old)."""
    tmp = model_dir / f".{CURRENT}.{os.getpid()}.{random.randrange(1 << 30)}"
    os.symlink(version, tmp)
    os.replace(tmp, model_dir / CURRENT)


class _Fetcher:
    """Parallel ranged GETs with retries; each file is hashed in order while it streams in."""

    def __init__(self, store: Store, concurrency: int, chunk_size: int) -> None:
        self.store = store
        self.concurrency = max(1, concurrency)
        self.chunk = max(1 << 16, chunk_size)
        self.downloaded = 0
        self._lock = threading.Lock()

    def fetch_all(self, jobs: list[tuple[Path, FileRef]], progress: ByteProgress) -> None:
        small = [j for j in jobs if j[1].size <= self.chunk]
        large = [j for j in jobs if j[1].size > self.chunk]
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="pull") as pool:
            # Small files: one GET each, many at once. Large files: one at a time, each split
            # into ranges fetched concurrently, so memory stays ~ concurrency × chunk.
            for f in [pool.submit(self._fetch_file, pool, t, r, progress, False) for t, r in small]:
                f.result()
            for target, ref in large:
                self._fetch_file(pool, target, ref, progress, True)

    def _fetch_file(
        self,
        pool: ThreadPoolExecutor,
        target: Path,
        ref: FileRef,
        progress: ByteProgress,
        split: bool,
    ) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.incomplete")
        key = blob_key(ref.sha256)
        offsets = range(0, ref.size, self.chunk) if ref.size else []
        get = lambda off: self._get(key, off, min(self.chunk, ref.size - off))  # noqa: E731
        hasher = hashlib.sha256()
        try:
            with open(tmp, "wb") as out:
                chunks = (
                    self._in_order(pool, get, offsets) if split else ((o, get(o)) for o in offsets)
                )
                for off, data in chunks:
                    self._consume(out, hasher, off, data, ref, progress)
            if hasher.hexdigest() != ref.sha256:
                raise IntegrityError(
                    f"{ref.path} ({key})",
                    f"sha256 mismatch: got {hasher.hexdigest()[:12]}…, "
                    f"manifest says {ref.sha256[:12]}…",
                    "the stored blob is corrupt; republish the release",
                )
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def _in_order(
        self, pool: ThreadPoolExecutor, get: Callable[[int], bytes], offsets: range
    ) -> Iterator[tuple[int, bytes]]:
        """Ranges fetched concurrently, yielded in file order; at most 2 × concurrency ahead."""
        window: deque[tuple[int, Future[bytes]]] = deque()
        for off in offsets:
            window.append((off, pool.submit(get, off)))
            if len(window) >= 2 * self.concurrency:
                o, fut = window.popleft()
                yield o, fut.result()
        while window:
            o, fut = window.popleft()
            yield o, fut.result()

    def _consume(
        self, out, hasher, off: int, data: bytes, ref: FileRef, progress: ByteProgress
    ) -> None:
        expected = min(self.chunk, ref.size - off)
        if len(data) != expected:
            raise IntegrityError(
                ref.path,
                f"short read at offset {off}: {len(data)} of {expected} bytes",
                "the stored blob is truncated",
            )
        out.write(data)
        hasher.update(data)
        with self._lock:
            self.downloaded += len(data)
        progress.advance(len(data))

    def _get(self, key: str, start: int, length: int) -> bytes:
        return with_retries(lambda: self.store.get_range(key, start, length))


def with_retries(fn: Callable[[], bytes], attempts: int = RETRIES, base: float = 0.2) -> bytes:
    """Retry throttling, 5xx and dropped connections (StoreError, OSError) with jittered
    exponential backoff; bad input and missing objects fail at once."""
    for attempt in range(attempts):
        try:
            return fn()
        except (StoreError, OSError, ConnectionError):
            if attempt == attempts - 1:
                raise
            time.sleep(base * (2**attempt) * (0.5 + random.random()))
        except PipelineError:
            raise
    raise AssertionError("unreachable")


__all__ = ["PullResult", "pull_release", "with_retries"]
