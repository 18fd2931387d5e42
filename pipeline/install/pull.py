"""``pull``: install a release from the store for the EKS init-container.

manifest → ranged GETs of several files at once → each part checked as it lands → atomic
install. See docs/pull.md for the flags, the defaults and why.

* A pool of ``concurrency`` threads takes ranges from one queue, a range of each file in
  turn, so small files and the ranges of large ones are all in flight together. A thread
  fetches a range, checks each manifest part in it against its sha256 (hashlib releases the
  GIL, so checks run on every core), and writes it at its offset with ``os.pwrite`` into a
  preallocated temporary file. Bytes in memory stay below concurrency × range size.
* Over plain HTTP one process: its threads hold the GIL about 0.04-0.05 s per GB landed
  (large socket reads), and worker processes gave 1.2x for 2.2x the memory on 16 cores.
  Over TLS (S3 itself) each read is one 16 KiB record that takes the GIL back, and one
  process landed ~1 GB/s on 16 cores: there the ranges are shared out to worker processes
  (``pipeline.install.processes``; ``processes``, chosen by the store; docs/pull.md).
* A bad part (wrong bytes, short read) is fetched again, alone, up to ``PART_RETRIES`` times.
  The whole-file sha256 (the blob's name) is checked where it costs nothing extra (a file of
  one range, hashed in memory), and for every file with ``verify="full"``. Files whose ref has
  no part digests (manifest schema 1) are checked whole after they land, and fetched again,
  whole, up to ``FILE_RETRIES`` times on a mismatch.
* Files land in ``DEST/<model>/.staging-<version>/`` (a stable name, so a restarted init
  container resumes: files already there and verified are kept, and so are the parts of a
  half-fetched file that match their digests); the staging directory is
  renamed to ``DEST/<model>/<version>`` only when every file is verified, then ``current`` is
  swapped atomically. A failure leaves the previous install and ``current`` untouched.

The threads are ``pipeline.install.fetcher``'s, one range's landing
``pipeline.install.landing``'s; this module orchestrates. None of them imports torch: the
pull must start fast in a slim image.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline._cpus import CGROUP, usable_cpus
from pipeline._files import atomic_write_bytes, sha256_file
from pipeline._progress import ByteProgress, byte_progress
from pipeline.install.fetcher import Fetcher, Verify
from pipeline.install.installed import (
    CURRENT,
    MANIFEST,
    SIGNATURE,
    release_files,
    temporary,
)
from pipeline.install.processes import WorkerProcesses
from pipeline.store.base import Store
from pipeline.store.refs import PART_SIZE, FileRef
from pipeline.store.signing import Trust
from pipeline.store.verified import read_verified

DEFAULT_PART = PART_SIZE  # bytes per ranged GET; rounded to whole manifest parts


# Concurrency: 4 threads per available CPU, at least 8 and at most 32 (64 where ranges
# stream, below). Threads mostly wait on the network; the CPU work (TLS, botocore, sha256)
# releases the GIL for large buffers. 8 keep a 2-CPU init container's network busy; 32 x
# 16 MiB = 512 MiB in flight is what an init container's memory limit should hold, and
# already saturates more than 2 CPUs.
MIN_CONCURRENCY, MAX_CONCURRENCY, THREADS_PER_CPU = 8, 32, 4
# Where ranges stream (``Store.streams_ranges``: S3 over https) a range in flight holds
# 1 MiB, not 16, so the cap is memory's no longer: at 16 GiB over TLS on 16 cores, 64 in
# flight landed 64 files in 0.85-0.94x the time of 32 and 4 files in 0.94x, with 2-12 % less
# CPU per GB and 33 MiB more peak memory; 128 was slower than 32 there (bench/RESULTS.md,
# thirty-third round), where nginx shares the cores and a connection is not the limit. On
# S3 it is: AWS advises one request in flight for each 85-90 MB/s wanted ("Best Practices
# Design Patterns: Optimizing Amazon S3 Performance", "Horizontal Scaling and Request
# Parallelization"), so 64 fill ~5.6 GB/s, less than an inf2.24xlarge's 50 Gbps or an
# inf2.48xlarge's 100 Gbps (12.5 GB/s: ~143 in flight). 4 per CPU reaches the cap at 36 CPUs;
# a 16-CPU node keeps 64.
MAX_STREAMED_CONCURRENCY = 144


CGROUP_CPU_MAX = CGROUP / "cpu.max"  # cgroup v2's limit; v1's sits beside it (pipeline._cpus)


def available_cpus() -> int:
    """CPUs this process may use, whole (``pipeline._cpus.usable_cpus``: a part of a CPU
    counts as one): a container on a 192-vCPU node with a 2-CPU limit gets 2, not 192."""
    return max(1, math.ceil(usable_cpus(CGROUP_CPU_MAX.parent)))


def default_processes(store: Store, cpus: int | None = None) -> int:
    """Worker processes for a pull from ``store`` (``Store.pull_processes``): more than one
    only where the store's reads bind one process (TLS), and where processes can fork."""
    if not hasattr(os, "fork"):
        return 1
    return store.pull_processes(available_cpus() if cpus is None else cpus)


def default_concurrency(cpus: int | None = None, *, streamed: bool = False) -> int:
    """Ranges in flight: 4 per CPU, 8 to 32, or to 144 where ranges stream (``streamed``)."""
    cpus = available_cpus() if cpus is None else cpus
    most = MAX_STREAMED_CONCURRENCY if streamed else MAX_CONCURRENCY
    return max(MIN_CONCURRENCY, min(most, THREADS_PER_CPU * cpus))


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
    parts: int = 0  # ranged GETs that landed (re-fetches not counted)
    refetched_parts: int = 0
    refetched_files: int = 0
    concurrency: int = 0
    processes: int = 1  # worker processes the ranges landed in (1: this one's threads)
    part_size: int = 0
    verify: str = "parts"
    signed_by: str | None = None  # the signing key's id, as stored
    signature: str = "not checked"  # "verified" against a trusted key, or "not checked"
    # seconds from the call's start to each phase's end (``PHASES``; docs/pull.md "Output")
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Downloaded bytes per second of the whole pull."""
        return self.downloaded_bytes / max(self.seconds, 1e-9)

    def to_dict(self) -> dict:
        return {**self.__dict__, "path": str(self.path), "throughput": round(self.throughput)}


# The phases a pull stamps, in order: the manifest read and checked (channel, manifest and
# signature GETs); the fetch started (worker processes forked); the first range, half and
# 90 % of the bytes to fetch landed (by the progress reports; a resumed range counts as
# landed); every range landed; the release installed. Between the half and 90 % marks the
# landing runs at its steady rate, so the marks show what its ramp and its tail cost
# (``bench/bench_pull.py`` prints them: bench/RESULTS.md).
PHASES = ("manifest", "fetch_started", "first_range", "half_landed", "ninety_landed",
          "landed", "installed")  # fmt: skip
_MARKS = (("first_range", 0.0), ("half_landed", 0.5), ("ninety_landed", 0.9))


class _Stamps:
    """A pull's phase stamps: seconds since ``start``."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.phases: dict[str, float] = {}

    def __call__(self, phase: str) -> None:
        self.phases[phase] = round(time.monotonic() - self.start, 4)


class _Marked(ByteProgress):
    """The progress reports passed on, stamping when the bytes landed pass each mark of
    ``_MARKS`` (of ``to_fetch``). Called from the fetch's threads."""

    def __init__(self, inner: ByteProgress, to_fetch: int, stamp: _Stamps) -> None:
        super().__init__(None, None)
        self.inner, self.to_fetch, self.stamp = inner, to_fetch, stamp
        self.landed, self.next = 0, 0
        self.lock = threading.Lock()

    def advance(self, n: int) -> None:
        self.inner.advance(n)
        with self.lock:
            self.landed += n
            while self.next < len(_MARKS) and self.landed > _MARKS[self.next][1] * self.to_fetch:
                self.stamp(_MARKS[self.next][0])
                self.next += 1


def pull_release(
    store: Store,
    model: str,
    dest: Path,
    *,
    version: str | None = None,
    channel: str | None = None,
    concurrency: int | None = None,
    processes: int | None = None,
    part_size: int = DEFAULT_PART,
    verify: Verify = "parts",
    trust: Trust | None = None,
) -> PullResult:
    """Install a release; see the module docstring. ``trust``: install only a release
    whose manifest a trusted key signed (``pipeline.store.verified``); nothing is written
    before that is checked. ``processes``: worker processes to land the files in (None:
    ``default_processes``); ``concurrency`` is the ranges in flight across all of them."""
    stamp = _Stamps(time.monotonic())
    cpus = None if concurrency and processes else available_cpus()  # the cgroup read once
    processes = processes or default_processes(store, cpus)
    release = read_verified(store, model, version=version, channel=channel, trust=trust)
    stamp("manifest")
    manifest, raw, version = release.manifest, release.data, release.manifest.version
    sig = release.signature.model_dump_json(indent=2).encode() if release.signature else None
    files = release_files(manifest)  # refuses paths that leave the release directory
    # a file without part digests (schema 1) is read a whole range at a time even there
    streamed = store.streams_ranges() and all(ref.parts is not None for _, ref in files)
    concurrency = concurrency or default_concurrency(cpus, streamed=streamed)
    model_dir = Path(dest) / model
    final = model_dir / version
    total = sum(ref.size for _, ref in files)
    result = PullResult(
        model, version, final, len(files), 0, total, 0.0, True,
        concurrency=concurrency, processes=processes, part_size=part_size, verify=verify,
        signed_by=release.signature.key_id if release.signature else None,
        signature="verified" if release.trusted else "not checked",
    )  # fmt: skip
    if (final / MANIFEST).is_file() and (final / MANIFEST).read_bytes() == raw:
        _install_signature(final, sig)  # signed since it was installed, or re-signed
        _point_current(model_dir, version)
        stamp("installed")
        return replace(result, seconds=time.monotonic() - stamp.start, phases=stamp.phases)

    staging = model_dir / f".staging-{version}"
    staging.mkdir(parents=True, exist_ok=True)
    _install_signature(staging, sig)
    return _pull_into(store, staging, final, model_dir, files, raw, result, stamp, part_size)


def _install_signature(release_dir: Path, sig: bytes | None) -> None:
    """``signature.json`` beside the manifest (what ``open_installed(trust=...)`` checks)."""
    path = release_dir / SIGNATURE
    if sig is None:
        path.unlink(missing_ok=True)
    elif not path.is_file() or path.read_bytes() != sig:
        atomic_write_bytes(path, sig)


def _pull_into(
    store: Store,
    staging: Path,
    final: Path,
    model_dir: Path,
    files: list[tuple[str, FileRef]],
    raw: bytes,
    result: PullResult,
    stamp: _Stamps,
    part_size: int,
) -> PullResult:
    model, version, concurrency, verify = (
        result.model, result.version, result.concurrency, result.verify,
    )  # fmt: skip
    total = result.reused_bytes
    # Resume: files a killed pull finished are kept if they still verify (checked in parallel).
    # A fresh staging directory holds none: a stat each says so without starting --concurrency
    # threads (~5 ms before the first GET).
    kept = [False] * len(files)
    if not all(_absent(staging / rel) for rel, _ in files):
        with ThreadPoolExecutor(concurrency) as checks:
            kept = list(checks.map(lambda f: _verified(staging / f[0], f[1]), files))
    # The same bytes under several paths (each bucket's weights.safetensors) download once.
    have: dict[str, Path] = {}
    fetching: set[str] = set()
    fetch, copies = [], []
    for (rel, ref), ok in zip(files, kept, strict=True):
        target = staging / rel
        if ok:
            have.setdefault(ref.sha256, target)
        elif ref.sha256 in have or ref.sha256 in fetching:
            copies.append((target, ref))
        else:
            fetch.append((target, ref))
            fetching.add(ref.sha256)
    reused = total - sum(ref.size for _, ref in fetch)
    fetcher: Fetcher | WorkerProcesses
    processes = result.processes if fetch else 1
    if processes > 1:  # forked before the progress bar's thread exists
        fetcher = WorkerProcesses(store, processes, concurrency, part_size, verify)
        fetcher.start(fetch)
        processes = fetcher.started
    else:
        fetcher = Fetcher(store, concurrency, part_size, verify)
    stamp("fetch_started")
    try:
        with byte_progress(f"pull {model} {version}", total) as progress:
            progress.advance(reused)
            fetcher.fetch_all(fetch, _Marked(progress, total - reused, stamp))
    finally:
        if isinstance(fetcher, WorkerProcesses):
            fetcher.close()
    stamp("landed")
    have.update({ref.sha256: target for target, ref in fetch})
    for target, ref in copies:
        _link_or_copy(have[ref.sha256], target)
    (staging / MANIFEST).write_bytes(raw)
    _replace_dir(staging, final)
    _point_current(model_dir, version)
    stamp("installed")
    return replace(
        result,
        downloaded_bytes=fetcher.downloaded,
        reused_bytes=reused + fetcher.resumed,
        seconds=time.monotonic() - stamp.start,
        phases=stamp.phases,
        already_installed=False,
        processes=processes,
        parts=fetcher.parts,
        refetched_parts=fetcher.refetched_parts,
        refetched_files=fetcher.refetched_files,
    )


def _absent(path: Path) -> bool:
    """Nothing at ``path`` (``_verified`` would say False without reading); other errors
    are raised as ``_verified`` raises them."""
    try:
        path.stat()
    except FileNotFoundError:
        return True
    return False


def _verified(path: Path, ref: FileRef) -> bool:
    try:
        return path.stat().st_size == ref.size and sha256_file(path) == ref.sha256
    except FileNotFoundError:
        return False


def _link_or_copy(src: Path, dest: Path) -> None:
    """A hard link where the filesystem allows (no extra disk), else a copy; atomic."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(dest)
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def _replace_dir(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``. An earlier, different install under that name is
    renamed aside first and deleted only after: ``final`` is missing for the moment between
    two renames, not for as long as deleting a release takes (nor for good, if the pull is
    killed meanwhile: the next pull of the version deletes what was set aside)."""
    aside = final.with_name(f".replaced-{final.name}")
    if aside.exists():
        shutil.rmtree(aside)
    if final.exists():
        os.rename(final, aside)
    os.rename(staging, final)
    shutil.rmtree(aside, ignore_errors=True)


def _point_current(model_dir: Path, version: str) -> None:
    """Swap ``current`` to ``version`` atomically (a new symlink renamed over the old)."""
    tmp = model_dir / f".{CURRENT}.{os.getpid()}.{random.randrange(1 << 30)}"
    os.symlink(version, tmp)
    os.replace(tmp, model_dir / CURRENT)


__all__ = [
    "PullResult",
    "available_cpus",
    "default_concurrency",
    "default_processes",
    "pull_release",
]
