"""The compile stage: cache lookups, then prepared weights, then one child process per
missing bucket.

Two kinds of cache entry (docs/finetune.md): each bucket's graphs, under its graph key, and
the release's prepared weights, under the weights key. For each bucket of this shard (most
expensive first) the graph key is looked up, and the weights key once; entries found are
hits (downloaded only with ``download=True``). Missing weights are prepared once in a
worker process; missing graphs compile in worker processes, ``jobs`` at a time, each with
its own log file and the config's timeout. Files go to the store as content-addressed blobs,
and only then their cache entry, so an entry that exists is complete: a crash or Ctrl-C
leaves at most unreferenced blobs. One bucket's failure never stops the others. A new
checkpoint of an architecture already compiled only prepares its weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline._files import atomic_write_text
from pipeline.compile import shards
from pipeline.compile.backends import backend_path, get_backend, resolve_backend
from pipeline.compile.backends.base import BucketJob
from pipeline.compile.keys import key_material, weights_key_material
from pipeline.compile.report import BucketResult, CompileReport, WeightsResult
from pipeline.compile.workers import POLL_S, kill_workers, last_error, spawn_worker
from pipeline.contracts.digests import digest, model_config_digest, weights_digest
from pipeline.errors import InputError
from pipeline.plan.config import Release
from pipeline.plan.report import release_gqa_plan
from pipeline.store import open_store
from pipeline.store.base import Store
from pipeline.store.blobs import put_blob
from pipeline.store.cache import CacheEntry, fetch_cache_entry, read_cache_entry
from pipeline.store.cache import write_cache_entry as _write_entry
from pipeline.store.refs import FileRef

LOG_FILE = "compile.log"  # each bucket's log; its blob is named in the entry's meta["log"]
LOOKUP_THREADS = 16

Event = Callable[[str, "BucketResult"], None]  # ("start" | "done", result)


def default_workdir(release: Release) -> Path:
    return Path("work") / "compile" / release.name


def compile_release(
    release: Release,
    *,
    backend: str | None = None,
    jobs: int = 1,
    shard: tuple[int, int] = (0, 1),
    workdir: Path | None = None,
    store: Store | str | None = None,
    download: bool = False,
    timeout_s: float | None = None,
    on_event: Event | None = None,
) -> CompileReport:
    """Compile this shard of the release's buckets into the store's cache; never raises for
    a bucket's failure (see ``CompileReport.failed``)."""
    if jobs < 1:
        raise InputError(f"--jobs {jobs}", "must be ≥ 1", None)
    start = time.monotonic()
    name = resolve_backend(backend or release.config.target.backend)
    be = get_backend(name)
    be.check_model(release.checkpoint)  # e.g. an architecture the backend cannot export
    store = open_store(store or release.store_url) if not isinstance(store, Store) else store
    workdir = Path(workdir or default_workdir(release)).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    weights = weights_digest(release.checkpoint, stat_cache=workdir / "weight-digests.json")
    versions = be.versions()
    wmaterial = weights_key_material(release, name, weights=weights, versions=versions)
    prepared = WeightsResult(digest(wmaterial), material=wmaterial)
    # A backend whose graphs hold the weights has no weights entry of its own.
    separate = not be.graphs_depend_on_weights
    results = []
    for b in shards.shard(release.buckets, *shard):
        material = key_material(release, b, name, weights=weights, versions=versions)
        r = BucketResult(b, digest(material), material=material)
        r.weights = prepared if separate else None
        results.append(r)
    emit = on_event or (lambda *_: None)
    # One GET per entry: concurrent, so a no-op run against S3 stays fast.
    keys = [r.key for r in results] + ([prepared.key] if separate else [])
    with ThreadPoolExecutor(LOOKUP_THREADS) as pool:
        found = dict(zip(keys, pool.map(lambda k: read_cache_entry(store, k), keys), strict=True))
    weights_entry = found.get(prepared.key) if separate else None
    if not separate:
        prepared.status = "in-graphs"
    elif weights_entry is not None:
        prepared.status, prepared.files = "cached", list(weights_entry.files)
    misses, hits = [], []
    for r in results:
        entry = found[r.key]
        if entry is None:
            r.log = workdir / "logs" / f"{r.bucket.name}.log"
            misses.append(r)
            continue
        r.status, r.files = "cached", list(entry.files)
        hits.append((r, entry))
    sched = _Scheduler(release, name, store, workdir, weights, versions, jobs, timeout_s, emit)
    ready = sched.prepare(prepared, misses) if misses or prepared.status == "pending" else True
    for r, entry in hits:
        if download:
            dest = _fresh_dir(workdir / "buckets" / r.bucket.name)
            fetch_cache_entry(store, entry, dest)
            if weights_entry is not None:
                fetch_cache_entry(store, weights_entry, dest)
            else:
                sched.link_weights(dest)
        emit("done", r)
    if misses and ready:
        sched.run(misses)
    return CompileReport(
        model=release.name,
        backend=name,
        store=store.url,
        shard=shard,
        workdir=workdir,
        weights_digest=weights,
        results=results,
        seconds=time.monotonic() - start,
        weights=prepared if separate else None,
    )


@dataclass
class _Running:
    result: BucketResult
    proc: subprocess.Popen
    started: float
    deadline: float
    out_dir: Path
    result_file: Path
    spec_file: Path


class _Scheduler:
    def __init__(
        self,
        release: Release,
        backend: str,
        store: Store,
        workdir: Path,
        weights: str,
        versions: dict[str, str],
        jobs: int,
        timeout_s: float | None,
        emit: Event,
    ) -> None:
        self.release, self.backend, self.store = release, backend, store
        self.workdir, self.weights, self.versions = workdir, weights, versions
        self.jobs, self.emit = jobs, emit
        self.timeout = float(timeout_s or release.config.compiler.timeout_s)
        self.uploaded: dict[tuple[int, int], FileRef] = {}  # shared files: hashed, sent once
        self.model_dir: Path = release.checkpoint
        self.shared: dict[str, Path] = {}

    def prepare(self, weights: WeightsResult, misses: list[BucketResult]) -> bool:
        """Prepare the weights (needed when they are missing from the store, and by compiled
        buckets' workdir copies); store them under the weights key if they were missing.
        False when that failed: then so has every miss (reported here)."""
        start = time.monotonic()
        try:
            self.model_dir, self.shared = self._prepare(weights.key)
            if weights.status == "pending":
                self._publish_weights(weights, time.monotonic() - start)
            return True
        except Exception as e:  # _PrepareFailed, or a store failure
            why = str(e) if isinstance(e, _PrepareFailed) else f"{type(e).__name__}: {e}"
            if weights.status == "pending":
                weights.status, weights.error = "failed", why
            for r in misses:
                r.status, r.error = "failed", why
                self.emit("done", r)
            return False

    def link_weights(self, bucket_dir: Path) -> None:
        """Make a workdir bucket runnable: the prepared weights beside its graphs. Not where
        the graphs hold the weights: there prepare's output is the compiler's input (neuron:
        the checkpoint handed to the exporter), not a file of the bucket."""
        if get_backend(self.backend).graphs_depend_on_weights:
            return
        for rel, path in self.shared.items():
            _link(path, bucket_dir / rel)

    def _publish_weights(self, weights: WeightsResult, seconds: float) -> None:
        """Blobs first, then the entry (as for graphs)."""
        refs = [self._put(path, rel) for rel, path in sorted(self.shared.items())]
        log = self.workdir / "logs" / "prepare.log"
        meta: dict[str, Any] = {
            "model": self.release.name,
            "weights_digest": self.weights,
            "versions": self.versions,
            "key_material": weights.material,
            "seconds": round(seconds, 3),
        }
        if log.is_file():
            meta["log"] = self._put(log, LOG_FILE).model_dump()
        entry = CacheEntry(
            key=weights.key, kind="weights", bucket="*", backend=self.backend, files=refs, meta=meta
        )
        _write_entry(self.store, entry)
        weights.status, weights.files, weights.seconds = "prepared", refs, seconds

    def run(self, misses: list[BucketResult]) -> None:
        running: list[_Running] = []
        try:
            queue = list(misses)
            while queue or running:
                while queue and len(running) < self.jobs:
                    running.append(self._start(queue.pop(0), self.model_dir, self.shared))
                time.sleep(POLL_S)
                for job in [j for j in running if self._finished(j)]:
                    running.remove(job)
        except BaseException:
            # Ctrl-C, SIGTERM (or any crash here): stop every child compiler at once, write
            # no entry. Were this process killed outright, the workers end themselves
            # (worker.die_with_parent).
            kill_workers(*(job.proc for job in running))
            for job in running:
                job.result.status, job.result.error = "interrupted", "stopped, no entry written"
                self.emit("done", job.result)
            raise

    # -- once per run ----------------------------------------------------------------------

    def _prepare(self, weights_key: str) -> tuple[Path, dict[str, Path]]:
        """The checkpoint to compile (GQA-padded when asked) and the prepared weights, kept in
        the workdir under names derived from their inputs (the weights key), so reruns reuse
        them."""
        be = get_backend(self.backend)
        cfg = self.release.config
        plan = release_gqa_plan(self.release)
        model_dir = self.release.checkpoint
        inputs = {
            "weights": self.weights,
            "model_config": model_config_digest(model_dir),
            "gqa": plan.to_dict(),
        }
        if be.wants_padded_checkpoint and plan.tp > 1 and plan.strategy != "none":
            model_dir = self.workdir / "padded" / digest(inputs)[:16]
            if not model_dir.is_dir():
                _pad(self.release.checkpoint, model_dir, plan.tp, cfg.target.gqa_strategy)
        shared_dir = self.workdir / "shared" / weights_key[:16]
        done = shared_dir / "prepared.json"
        if done.is_file():
            return model_dir, {k: Path(v) for k, v in json.loads(done.read_text()).items()}
        shared_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "kind": "prepare",
            "name": "prepare",
            "backend": backend_path(self.backend),
            "model_dir": str(model_dir),
            "dtype": cfg.model.dtype,
            "out_dir": str(shared_dir),
        }
        log = self.workdir / "logs" / "prepare.log"
        result_file = shared_dir / f".result.{os.getpid()}.json"
        spec_file = shared_dir / f".spec.{os.getpid()}.json"
        proc = spawn_worker(spec, spec_file, result_file, log)
        try:
            code = proc.wait(timeout=self.timeout)
            if code != 0 or not result_file.is_file():
                raise _PrepareFailed(f"prepare failed: {last_error(log, code)} (log: {log})")
            files = json.loads(result_file.read_text())["files"]
        except subprocess.TimeoutExpired:
            kill_workers(proc)
            raise _PrepareFailed(
                f"prepare timed out after {self.timeout:g}s (log: {log})"
            ) from None
        except BaseException:
            kill_workers(proc)
            raise
        finally:
            result_file.unlink(missing_ok=True)
            spec_file.unlink(missing_ok=True)
        atomic_write_text(done, json.dumps(files))
        return model_dir, {k: Path(v) for k, v in files.items()}

    # -- per bucket ------------------------------------------------------------------------

    def _start(self, r: BucketResult, model_dir: Path, shared: dict[str, Path]) -> _Running:
        cfg = self.release.config
        plan = release_gqa_plan(self.release)
        out_dir = _fresh_dir(self.workdir / "tmp" / f"{r.bucket.name}.{os.getpid()}")
        mixed = self.release.grid.mixed_lengths  # None: the backend's default
        job = BucketJob(
            model_dir=model_dir,
            bucket=r.bucket,
            tp=cfg.target.tp_degree,
            gqa=plan.to_dict(),
            dtype=cfg.model.dtype,
            flags=tuple(cfg.compiler.flags),
            auto_cast_type=cfg.compiler.auto_cast_type,
            out_dir=out_dir,
            shared=shared,
            instance_type=cfg.target.instance_type,
            prefill_lengths=tuple(self.release.grid.prefill_lengths),
            mixed_lengths=None if mixed is None else tuple(mixed),
        )
        spec = {
            "kind": "bucket",
            "name": r.bucket.name,
            "backend": backend_path(self.backend),
            "job": job.to_dict(),
        }
        assert r.log is not None
        result_file = out_dir.parent / f"{out_dir.name}.result.json"
        spec_file = out_dir.parent / f"{out_dir.name}.spec.json"
        proc = spawn_worker(spec, spec_file, result_file, r.log)
        now = time.monotonic()
        r.status = "compiling"
        self.emit("start", r)
        return _Running(r, proc, now, now + self.timeout, out_dir, result_file, spec_file)

    def _finished(self, job: _Running) -> bool:
        r = job.result
        code = job.proc.poll()
        if code is None and time.monotonic() < job.deadline:
            return False
        r.seconds = time.monotonic() - job.started
        if code is None:
            kill_workers(job.proc)
            r.status, r.error = "timeout", f"timed out after {self.timeout:g}s"
        elif code != 0 or not job.result_file.is_file():
            r.status, r.error = "failed", last_error(r.log, code)
        else:
            try:
                self._publish(r, job)
                r.status = "compiled"
            except Exception as e:  # an unreadable result or a store failure: this bucket only
                r.status, r.error = "failed", f"{type(e).__name__}: {e}"
        # What a failed bucket left is in its log; its partial outputs go.
        shutil.rmtree(job.out_dir, ignore_errors=True)
        for f in (job.result_file, job.spec_file):
            f.unlink(missing_ok=True)
        self.emit("done", r)
        return True

    def _publish(self, r: BucketResult, job: _Running) -> None:
        """Blobs first, then the entry: an entry that exists names only stored blobs."""
        result = json.loads(job.result_file.read_text())
        final = self.workdir / "buckets" / r.bucket.name
        _replace_dir(job.out_dir, final)
        self.link_weights(final)
        files = {
            rel: final / Path(p).relative_to(job.out_dir) for rel, p in result["files"].items()
        }
        assert r.log is not None
        refs = [self._put(path, rel) for rel, path in sorted(files.items())]
        # The log is kept in the store but is not a release file: it holds times and pids,
        # and release files must be the same bytes whichever machine compiled them.
        log = self._put(r.log, LOG_FILE)
        meta = {
            "model": self.release.name,
            "log": log.model_dump(),
            "versions": self.versions,
            "key_material": r.material,
            "seconds": round(r.seconds, 3),
            "backend_meta": result.get("meta", {}),
        }
        if get_backend(self.backend).graphs_depend_on_weights:
            meta["weights_digest"] = self.weights  # else the graphs serve any checkpoint
        entry = CacheEntry(
            key=r.key, bucket=r.bucket.name, backend=self.backend, files=refs, meta=meta
        )
        _write_entry(self.store, entry)
        r.files = refs

    def _put(self, path: Path, rel: str) -> FileRef:
        # Hard-linked shared files (weights) have one inode: hash and upload them once.
        st = path.stat()
        cached = self.uploaded.get((st.st_dev, st.st_ino))
        if cached is not None:
            return cached.model_copy(update={"path": rel})
        ref, _ = put_blob(self.store, path, rel)
        self.uploaded[(st.st_dev, st.st_ino)] = ref
        return ref


class _PrepareFailed(Exception):
    pass


def _fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _link(src: Path, dest: Path) -> None:
    """Hard-link (shared weights cost no space per bucket); copy across filesystems."""
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def _replace_dir(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    old = dest.with_name(f".{dest.name}.old.{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    src.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _pad(src: Path, out: Path, tp: int, strategy: str) -> None:
    try:
        from pipeline.compile.gqa_pad import pad_checkpoint
    except ImportError:
        raise InputError(
            "GQA padding",
            f"tp {tp} needs the padded checkpoint, and pipeline.compile.gqa_pad is not available",
            "install inf2-pipeline[torch]",
        ) from None
    pad_checkpoint(src, out, tp, strategy)
