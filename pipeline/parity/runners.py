"""How parity runs one bucket of a release step by step, per backend (named in the backend
table, ``pipeline.backends``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any, Protocol

from pipeline.errors import RuntimeMismatchError
from pipeline.install.installed import InstalledRelease
from pipeline.plan.buckets import Bucket


class BucketRunner(Protocol):
    """One bucket of a release, runnable: what ``DecodeSession`` provides."""

    batch: int
    seq: int

    def prefill(self, tokens: Any, lengths: Any) -> Any: ...
    def decode(self, tokens: Any, positions: Any) -> Any: ...
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None
    ) -> list[list[int]]: ...


class AotiRunner:
    """cpu and cuda releases: the serving runtime itself (``BucketedModel``)."""

    def __init__(self, installed: InstalledRelease, *, cuda_graphs: bool) -> None:
        from pipeline.runtime.aoti import AotiRunner as Runtime

        self.runtime = Runtime(installed, cuda_graphs=cuda_graphs)
        self.device = self.runtime.device

    def session(self, bucket: str) -> BucketRunner:
        return self.runtime.session(Bucket.parse(bucket))


class NeuronRunner:
    """neuron releases: need torch-neuronx on a host with NeuronCores."""

    device = "neuron"

    def __init__(self, installed: InstalledRelease, *, cuda_graphs: bool) -> None:
        what = installed.what
        if importlib.util.find_spec("torch_neuronx") is None:
            raise RuntimeMismatchError(
                what,
                "is a neuron release and the Neuron runtime (torch-neuronx) is not installed here",
                "run parity on an inf2/trn1 host with the AWS Neuron SDK: pip install "
                "--extra-index-url https://pip.repos.neuron.amazonaws.com torch-neuronx "
                "optimum-neuron",
            )
        raise RuntimeMismatchError(
            what,
            "running neuron buckets step by step is not implemented in this inf2-pipeline",
            "check the release with NxD Inference's own accuracy tools meanwhile",
        )

    def session(self, bucket: str) -> BucketRunner:  # pragma: no cover - see __init__
        raise NotImplementedError
