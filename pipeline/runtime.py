"""Serving from an installed release: pick the nearest compiled bucket, pad, run, unpad.

    model = BucketedModel.load("/models/llama-3-8b")      # follows current → the release
    model.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)  # new tokens per prompt

Runs the cpu and cuda releases (AOTInductor packages, see ``pipeline.graph_abi``). A neuron
release needs the Neuron runtime, which this loader says plainly instead of failing later.
Buckets load on first use; ``warmup()`` loads them all. All buckets of a release share one
copy of the weights in memory (their weights.safetensors files are the same blob). Each
bucket runs in a ``DecodeSession`` (its own KV caches; on cuda, its decode step replayed as a
CUDA graph: ``cuda_graphs=False`` turns that off, to compare or debug).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.buckets import Bucket, select_bucket
from pipeline.errors import InputError, IntegrityError, RuntimeMismatchError
from pipeline.graph_abi import (
    WEIGHTS_FILE,
    BucketGraphs,
    GraphSpec,
    check_runs_here,
    load_weights,
)
from pipeline.release_dir import BUCKETS, MANIFEST, release_files, resolve_release
from pipeline.store.manifest import Manifest

if TYPE_CHECKING:
    from pipeline.decode_session import DecodeSession

RUNNABLE = ("cpu", "cuda")


class BucketedModel:
    def __init__(
        self, release_dir: Path, manifest: Manifest, device: str, *, cuda_graphs: bool = True
    ) -> None:
        self.dir = release_dir
        self.manifest = manifest
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.buckets = sorted(Bucket(b.batch, b.seq) for b in manifest.buckets.values())
        self.max_batch = max(b.batch for b in self.buckets)
        self.max_seq = max(b.seq for b in self.buckets)
        self.eos_token_id = _eos_token_id(release_dir)
        self._graphs: dict[Bucket, BucketGraphs] = {}
        self._weights: dict[str, dict[str, Any]] = {}  # by blob digest: one copy per release
        self._sessions: dict[Bucket, DecodeSession] = {}

    @classmethod
    def load(
        cls, path: Path | str, backend: str = "auto", *, cuda_graphs: bool = True
    ) -> BucketedModel:
        """``DIR/MODEL`` (following ``current``) or a release directory; checks the manifest,
        the files, and that this runtime can run the release."""
        release_dir = resolve_release(Path(path))
        try:
            manifest = Manifest.model_validate_json((release_dir / MANIFEST).read_bytes())
        except ValueError as e:
            raise InputError(
                str(release_dir / MANIFEST),
                f"not a release manifest: {e}",
                "pull the release again",
            ) from None
        _check_runnable(manifest, backend)
        for rel, ref in release_files(manifest):
            path_ = release_dir / rel
            if not path_.is_file() or path_.stat().st_size != ref.size:
                raise IntegrityError(
                    str(path_),
                    "missing or of the wrong size",
                    "the install is incomplete; pull the release again",
                )
        # Graph ABI and GPU architecture: refuse now, not on the first request.
        first = release_dir / BUCKETS / sorted(manifest.buckets)[0]
        check_runs_here(GraphSpec.read(first), first)
        return cls(release_dir, manifest, manifest.backend, cuda_graphs=cuda_graphs)

    def select(self, batch: int, seq: int) -> Bucket:
        """The bucket with the fewest padded tokens holding ``batch`` rows of ``seq`` tokens."""
        if seq > self.max_seq:
            raise InputError(
                f"sequence of {seq} tokens",
                f"longer than the largest bucket ({self.max_seq})",
                "shorten the request or compile a larger bucket",
            )
        if batch > self.max_batch:
            raise InputError(
                f"batch of {batch}",
                f"larger than the largest bucket ({self.max_batch})",
                "generate() splits large batches for you",
            )
        bucket = select_bucket(self.buckets, batch, seq)
        if bucket is None:  # the grid is not a full product: no bucket has both
            raise InputError(
                f"batch {batch} × {seq} tokens",
                "no compiled bucket holds it",
                f"buckets: {', '.join(b.name for b in self.buckets)}",
            )
        return bucket

    def warmup(self) -> None:
        """Load every bucket, allocate its caches and record its CUDA graph."""
        for bucket in self.buckets:
            self.session(bucket)

    def session(self, bucket: Bucket) -> DecodeSession:
        """The bucket's graphs with their own caches (made on first use)."""
        from pipeline.decode_session import DecodeSession

        if bucket not in self._sessions:
            graphs = self._bucket(bucket)
            self._sessions[bucket] = DecodeSession(graphs, cuda_graphs=self.cuda_graphs)
        return self._sessions[bucket]

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None = -1
    ) -> list[list[int]]:
        """Greedy decoding; returns the new tokens of each prompt (stopping after EOS).

        ``eos_token_id``: -1 (default) uses the release's, None never stops early.
        """
        if max_new_tokens < 1:
            raise InputError("max_new_tokens", f"must be ≥ 1, got {max_new_tokens}", None)
        eos = self.eos_token_id if eos_token_id == -1 else eos_token_id
        vocab = self._vocab()
        for i, p in enumerate(prompts):
            if not p:
                raise InputError(f"prompt {i}", "is empty", "give at least one token id")
            bad = [t for t in p if not 0 <= int(t) < vocab]
            if bad:
                raise InputError(
                    f"prompt {i}",
                    f"token ids {bad[:5]} outside the vocabulary (0..{vocab - 1})",
                    None,
                )
        out: list[list[int]] = []
        for start in range(0, len(prompts), self.max_batch):
            out += self._generate_batch(
                prompts[start : start + self.max_batch], max_new_tokens, eos
            )
        return out

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new: int, eos: int | None
    ) -> list[list[int]]:
        # The cache must hold the prompt and every generated token but the last.
        need = max(len(p) for p in prompts) + max_new - 1
        return self.session(self.select(len(prompts), need)).generate(prompts, max_new, eos)

    def _bucket(self, bucket: Bucket) -> BucketGraphs:
        if bucket not in self._graphs:
            entry = self.manifest.buckets[bucket.name]
            ref = next(r for r in entry.files if r.path == WEIGHTS_FILE)
            bucket_dir = self.dir / BUCKETS / bucket.name
            if ref.sha256 not in self._weights:
                self._weights[ref.sha256] = load_weights(bucket_dir / WEIGHTS_FILE, self.device)
            # Single-threaded packages: CUDA graph capture needs them, and a bucket's one
            # cache serialises its calls anyway.
            self._graphs[bucket] = BucketGraphs(
                bucket_dir, self.device, weights=self._weights[ref.sha256], single_threaded=True
            )
        return self._graphs[bucket]

    def _vocab(self) -> int:
        config = json.loads((self.dir / "config.json").read_text())
        return int(config["vocab_size"])


def _eos_token_id(release_dir: Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        path = release_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return int(eos[0] if isinstance(eos, list) else eos)
    return None


def _check_runnable(manifest: Manifest, backend: str) -> None:
    import torch

    if manifest.backend not in RUNNABLE:
        raise RuntimeMismatchError(
            f"release {manifest.model} {manifest.version}",
            f"was compiled for '{manifest.backend}', which this runtime cannot run",
            "serve neuron releases with torch-neuronx/NxD Inference on an inf2 host, "
            "or pull the model's cuda/cpu release",
        )
    if backend not in ("auto", manifest.backend):
        raise RuntimeMismatchError(
            f"release {manifest.model} {manifest.version}",
            f"was compiled for '{manifest.backend}', not '{backend}'",
            "AOTInductor packages run only on the device they were compiled for",
        )
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
