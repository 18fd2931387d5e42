"""The runner of cpu and cuda releases: AOTInductor packages (``pipeline.contracts.graph_abi``).

All buckets of a release share one copy of the weights in memory (their weights.safetensors
files are the same blob). Each bucket runs in a ``DecodeSession`` (its own KV caches; on cuda,
its decode step replayed as a CUDA graph: ``cuda_graphs=False`` turns that off, to compare or
debug).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.contracts.bucket import Bucket
from pipeline.contracts.graph_abi import WEIGHTS_FILE, GraphSpec
from pipeline.errors import RuntimeMismatchError
from pipeline.install.installed import InstalledRelease
from pipeline.runtime.graph_loading import BucketGraphs, check_runs_here, load_weights
from pipeline.store.manifest import Manifest

if TYPE_CHECKING:
    from pipeline.runtime.decode_session import DecodeSession
    from pipeline.runtime.session_slots import SessionSlots

log = logging.getLogger("inf2_pipeline.runtime")


class AotiRunner:
    def __init__(self, installed: InstalledRelease, *, cuda_graphs: bool = True) -> None:
        _check_runnable(installed.manifest)
        # Graph ABI and GPU architecture: refuse now, not on the first request.
        first = installed.bucket_dir(sorted(installed.manifest.buckets)[0])
        check_runs_here(GraphSpec.read(first), first)
        self.installed = installed
        self.manifest = installed.manifest
        self.device = installed.manifest.backend
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[Bucket, BucketGraphs] = {}
        self._weights: dict[str, dict[str, Any]] = {}  # by blob digest: one copy per release
        self._weights_seconds: dict[Bucket, float] = {}  # the bucket whose load read them
        self._sessions: dict[Bucket, DecodeSession] = {}
        self._slots: dict[Bucket, SessionSlots] = {}

    def tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # The cache holds the prompt and every generated token but the last.
        return prompt_len + max_new_tokens - 1

    def warmup(self, buckets: Sequence[Bucket]) -> None:
        """Load every bucket, allocate its caches and record its CUDA graphs, each bucket's
        time logged by part: a server's start is mostly this on cuda (~40 s for three s256
        buckets on an H100, bench/RESULTS.md), and the line says which part to cut."""
        for bucket in buckets:
            earlier = bucket in self._graphs  # its parts below were timed at that load
            start = time.perf_counter()
            bucket_graphs = self._bucket(bucket)
            loaded = time.perf_counter()
            graphs = self.session(bucket).recorded
            made = f"caches and {graphs} CUDA graphs" if graphs else "caches"
            took = bucket_graphs.load_seconds
            slowest = max(took, key=took.__getitem__)
            log.info(
                "%s: packages and weights %s (weights %.1f s, %d packages %.1f s, "
                "slowest %s %.1f s), %s %.1f s",
                bucket.name,
                "loaded earlier" if earlier else f"{loaded - start:.1f} s",
                self._weights_seconds.get(bucket, 0.0),
                len(took),
                sum(took.values()),
                slowest,
                took[slowest],
                made,
                time.perf_counter() - loaded,
            )

    def session(self, bucket: Bucket) -> DecodeSession:
        """The bucket's graphs with their own caches (made on first use)."""
        from pipeline.runtime.decode_session import DecodeSession

        if bucket not in self._sessions:
            graphs = self._bucket(bucket)
            self._sessions[bucket] = DecodeSession(graphs, cuda_graphs=self.cuda_graphs)
        return self._sessions[bucket]

    def slots(self, bucket: Bucket) -> SessionSlots:
        """The bucket's rows as slots (``Slots``), on the same session and caches."""
        from pipeline.runtime.session_slots import SessionSlots

        if bucket not in self._slots:
            self._slots[bucket] = SessionSlots(self.session(bucket))
        return self._slots[bucket]

    def _bucket(self, bucket: Bucket) -> BucketGraphs:
        if bucket not in self._graphs:
            entry = self.manifest.buckets[bucket.name]
            ref = next(r for r in entry.files if r.path == WEIGHTS_FILE)
            bucket_dir = self.installed.bucket_dir(bucket.name)
            if ref.sha256 not in self._weights:
                start = time.perf_counter()
                self._weights[ref.sha256] = load_weights(bucket_dir / WEIGHTS_FILE, self.device)
                self._weights_seconds[bucket] = time.perf_counter() - start
            # Single-threaded packages: CUDA graph capture needs them, and a bucket's one
            # cache serialises its calls anyway.
            self._graphs[bucket] = BucketGraphs(
                bucket_dir, self.device, weights=self._weights[ref.sha256], single_threaded=True
            )
        return self._graphs[bucket]


def _check_runnable(manifest: Manifest) -> None:
    import torch

    if manifest.backend == "cuda" and not torch.cuda.is_available():
        raise RuntimeMismatchError(
            f"release {manifest.model} {manifest.version}",
            "is a cuda release and this machine has no CUDA GPU",
            None,
        )
    built = manifest.versions.get("torch", "")
    if _minor(built) != _minor(torch.__version__):
        raise RuntimeMismatchError(
            f"release {manifest.model} {manifest.version}",
            f"was compiled with torch {built}, this runtime has torch {torch.__version__}",
            "AOTInductor packages need the same torch minor version; recompile or match torch",
        )


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])
