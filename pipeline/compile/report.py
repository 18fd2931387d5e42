"""What a compile run reports: each bucket's graphs and the release's prepared weights
(``compile_release`` returns a ``CompileReport``; ``pipeline.compile.progress`` draws it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contracts.bucket import Bucket
from pipeline.store.refs import FileRef

# What became of a bucket's graphs and of the release's prepared weights, as reported.
GRAPH_WORDS = {"cached": "hit"}  # others as they are: compiled | failed | timeout | ...
WEIGHTS_WORDS = {"cached": "hit"}  # prepared | in-graphs | failed | pending


@dataclass
class WeightsResult:
    """The release's prepared weights: one set, bound by every bucket."""

    key: str
    # cached | prepared | failed | pending | in-graphs (the backend's graphs hold them)
    status: str = "pending"
    seconds: float = 0.0
    error: str | None = None
    files: list[FileRef] = field(default_factory=list)
    material: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status in ("cached", "prepared", "in-graphs")

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": WEIGHTS_WORDS.get(self.status, self.status),
            "key": self.key,
            "seconds": round(self.seconds, 3),
            "error": self.error,
            "files": [f.model_dump() for f in self.files],
        }


@dataclass
class BucketResult:
    bucket: Bucket
    key: str  # the graph key
    status: str = "pending"  # the graphs: cached | compiled | failed | timeout | interrupted
    seconds: float = 0.0
    log: Path | None = None
    error: str | None = None
    files: list[FileRef] = field(default_factory=list)  # the graphs' files
    material: dict[str, Any] = field(default_factory=dict, repr=False)  # what the key hashes
    weights: WeightsResult | None = None  # shared by every bucket of the run

    @property
    def cache_hit(self) -> bool:
        return self.status == "cached"

    @property
    def graph(self) -> str:
        """hit | compiled | failed | timeout | interrupted | pending"""
        return GRAPH_WORDS.get(self.status, self.status)

    @property
    def weights_status(self) -> str:
        """hit | prepared | in-graphs | failed | pending"""
        w = self.weights
        return WEIGHTS_WORDS.get(w.status, w.status) if w else "in-graphs"

    @property
    def ok(self) -> bool:
        return self.status in ("cached", "compiled") and (self.weights is None or self.weights.ok)

    def to_dict(self) -> dict[str, Any]:
        w = self.weights
        return {
            "bucket": self.bucket.name,
            "status": self.status,
            "graph": self.graph,
            "weights": self.weights_status,
            "seconds": round(self.seconds, 3),
            "cache_hit": self.cache_hit,
            "key": self.key,
            "graph_key": self.key,
            "weights_key": w.key if w else None,
            "log": str(self.log) if self.log else None,
            "error": self.error or (w.error if w else None),
            "files": [f.model_dump() for f in self.files],
            "weights_files": [f.model_dump() for f in w.files] if w else [],
        }


@dataclass
class CompileReport:
    model: str
    backend: str
    store: str
    shard: tuple[int, int]
    workdir: Path
    weights_digest: str
    results: list[BucketResult]
    seconds: float = 0.0
    weights: WeightsResult | None = None  # None: the backend's graphs hold the weights

    @property
    def failed(self) -> list[BucketResult]:
        return [r for r in self.results if not r.ok]

    @property
    def compiled(self) -> int:
        return sum(r.status == "compiled" for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.status] = counts.get(r.status, 0) + 1
        return {
            "model": self.model,
            "backend": self.backend,
            "store": self.store,
            "shard": f"{self.shard[0]}/{self.shard[1]}",
            "workdir": str(self.workdir),
            "weights_digest": self.weights_digest,
            "seconds": round(self.seconds, 3),
            "counts": counts,
            "compiled": self.compiled,
            "weights": self.weights.to_dict() if self.weights else {"status": "in-graphs"},
            "failed": [r.bucket.name for r in self.failed],
            "buckets": [r.to_dict() for r in self.results],
        }
