"""The release under test, per backend: how parity runs one bucket of it step by step (each
named in the backend table, ``pipeline.contracts.backend_table``). They wrap the serving
runtime's own runners, so parity checks what the pods run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pipeline.contracts.bucket import Bucket
from pipeline.install.installed import InstalledRelease


class BucketSession(Protocol):
    """One bucket of a release, runnable: what ``DecodeSession`` provides."""

    batch: int
    seq: int

    def prefill(self, tokens: Any, lengths: Any) -> Any: ...
    def decode(self, tokens: Any, positions: Any) -> Any: ...
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None
    ) -> list[list[int]]: ...


class AotiTarget:
    """cpu and cuda releases: the serving runtime itself (``BucketedModel``)."""

    def __init__(self, installed: InstalledRelease, *, cuda_graphs: bool) -> None:
        from pipeline.runtime.aoti import AotiRunner as Runtime

        self.runtime = Runtime(installed, cuda_graphs=cuda_graphs)
        self.device = self.runtime.device

    def session(self, bucket: str) -> BucketSession:
        return self.runtime.session(Bucket.parse(bucket))


class NeuronTarget:
    """neuron releases: the serving runtime itself (``pipeline.runtime.neuron``), one bucket
    loaded at a time. Greedy tokens only: Llama/Qwen exports sample on the device
    (``on_device_sampling``, optimum/neuron/models/inference/llama/modeling_llama.py:341-363)
    and their generate() rejects output_logits and output_scores
    (backend/modules/generation/generation_utils.py:76-97), so no logits come back."""

    device = "neuron"
    logits = False  # parity compares greedy tokens, never logits
    needs_checkpoint = True  # the release's weights are NxD shards: the reference reads HF's

    def __init__(self, installed: InstalledRelease, *, cuda_graphs: bool) -> None:
        from pipeline.runtime.neuron import NeuronRunner as Runtime

        self.runtime = Runtime(installed)

    def session(self, bucket: str) -> BucketSession:
        b = Bucket.parse(bucket)
        for other in self.runtime.loaded:  # parity walks the buckets once: free the last
            if other != b:
                self.runtime.unload(other)
        return self.runtime.session(b)  # type: ignore[return-value]
