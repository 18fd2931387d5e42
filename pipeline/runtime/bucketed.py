"""Serving from an installed release: pick the nearest compiled bucket, pad, run, unpad.

    model = BucketedModel.load("/models/llama-3-8b")      # follows current → the release
    model.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)  # new tokens per prompt

What is common to every backend lives here: reading and checking the installed release
(``pipeline.install.installed``), choosing the bucket with the fewest padded tokens,
splitting batches larger than the largest bucket, and checking prompts. Running a bucket is
the backend's runner's job (``pipeline.runtime.runners``; the backend table names it), so a
new backend serves through this class unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.contracts.bucket import Bucket, select_bucket
from pipeline.errors import InputError
from pipeline.install.installed import InstalledRelease, open_installed, reading
from pipeline.runtime.runners import Runner, Session, Slots, open_runner
from pipeline.store.signing import Trust


class BucketedModel:
    def __init__(self, installed: InstalledRelease, runner: Runner) -> None:
        self.installed = installed
        self.dir = installed.dir
        self.manifest = installed.manifest
        self.runner = runner
        self.device = runner.device
        self.buckets = sorted(Bucket(b.batch, b.seq) for b in self.manifest.buckets.values())
        self.max_batch = max(b.batch for b in self.buckets)
        self.max_seq = max(b.seq for b in self.buckets)
        with reading(installed, buckets=()):
            self.eos_token_ids = _eos_token_ids(self.dir)
            self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
            self._vocab_size = int(json.loads((self.dir / "config.json").read_text())["vocab_size"])

    @classmethod
    def load(
        cls,
        path: Path | str,
        backend: str = "auto",
        *,
        cuda_graphs: bool = True,
        trust: Trust | None = None,
        **options: Any,
    ) -> BucketedModel:
        """``DIR/MODEL`` (following ``current``) or a release directory; checks the manifest
        (with ``trust``: its signature, before anything else is read), the files (by size),
        and that this runtime can run the release. ``options`` go to the backend's runner
        (neuron: ``hbm_budget``, bytes per NeuronCore)."""
        installed = open_installed(path, verify="size", trust=trust)
        with reading(installed):
            runner = open_runner(installed, backend, cuda_graphs=cuda_graphs, **options)
        return cls(installed, runner)

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
        """Load the buckets (those that fit, where the runner has a memory budget)."""
        with reading(self.installed, [b.name for b in self.buckets]):
            self.runner.warmup(self.buckets)

    def warm_buckets(self) -> list[Bucket]:
        """The buckets ``warmup`` left loaded: every one, unless the runner keeps only what
        fits a memory budget (neuron's ``loaded``)."""
        return list(getattr(self.runner, "loaded", self.buckets))

    def session(self, bucket: Bucket) -> Session:
        """The bucket, loaded on first use."""
        with reading(self.installed, [bucket.name]):
            return self.runner.session(bucket)

    def slots(self, bucket: Bucket) -> Slots:
        """The bucket as slots, one request each (``serve``'s engine drives these)."""
        with reading(self.installed, [bucket.name]):
            return self.runner.slots(bucket)

    def tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """The sequence length a bucket must have for this request (the runner decides:
        a cache that holds every token but the last, or the whole sequence)."""
        return self.runner.tokens_needed(prompt_len, max_new_tokens)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None = -1
    ) -> list[list[int]]:
        """Greedy decoding; returns the new tokens of each prompt (stopping after EOS).

        ``eos_token_id``: -1 (default) uses the release's, None never stops early.
        """
        if max_new_tokens < 1:
            raise InputError("max_new_tokens", f"must be ≥ 1, got {max_new_tokens}", None)
        eos = self.eos_token_id if eos_token_id == -1 else eos_token_id
        vocab = self.vocab_size()
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
        need = self.tokens_needed(max(len(p) for p in prompts), max_new)
        return self.session(self.select(len(prompts), need)).generate(prompts, max_new, eos)

    def vocab_size(self) -> int:
        return self._vocab_size


def _eos_token_ids(release_dir: Path) -> tuple[int, ...]:
    """Every token that ends an answer (generation_config's list where it has one: Llama 3's
    instruct models end a chat turn with <|eot_id|>, not with the base model's EOS)."""
    for name in ("generation_config.json", "config.json"):
        path = release_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()
