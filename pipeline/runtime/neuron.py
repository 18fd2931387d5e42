"""The runner of neuron releases: optimum-neuron exports, loaded lazily under an HBM budget.

Each bucket of a neuron release is one optimum-neuron export (one prefill graph at its
sequence length, one decode graph, a fixed batch) with its own weights shards. On first use a
bucket is loaded with ``NeuronModelForCausalLM.from_pretrained(bucket_dir)``; every loaded
bucket holds its own weights copy and KV cache on the NeuronCores, so the runner keeps loaded
only what fits the budget per NeuronCore, by the same arithmetic as ``plan``
(``pipeline.plan.memory``), and unloads the least recently used bucket to make room.

A session right-pads its prompts with an attention mask (upstream refuses left padding:
optimum/neuron/models/inference/backend/modules/generation/generation_utils.py:139), pads the
batch up to the export's with copies of a real prompt, and strips those rows. The whole
sequence (prompt and new tokens) must fit the export's sequence length
(generation_utils.py:76-97 refuses longer inputs).

The serving engine drives a bucket as slots instead (``NeuronSlots``, the ``Slots`` interface):
an export of batch B > 1 is a continuous-batching model with one KV-cache line per batch row
(modeling_llama.py:351), and the engine calls its ``forward`` the way optimum-neuron's own vLLM
runner does (vllm/runner.py). A bucket serves one kind of caller at a time: ``generate``
refuses while slots are active (it would prefill every cache line), and the runner never
evicts a bucket with active slots.

Citations are file:line of optimum-neuron 0.4.5 as installed, under optimum/neuron/:
vllm/runner.py, vllm/model_loader.py, vllm/sampler.py; under its models/inference/:
llama/modeling_llama.py, qwen2/modeling_qwen2.py, qwen3/modeling_qwen3.py,
backend/config.py; under models/inference/backend/modules/: decoder/modeling_decoder.py,
decoder/decoder_wrappers.py, kvcache/kv_cache_manager.py, generation/sampling.py,
generation/generation_utils.py.

Contract-tested against a stand-in ``optimum.neuron`` (tests/neuron_standin) whose signatures
are checked against the real classes, and whose ``forward`` calls from this engine are replayed
through upstream's real forward and graph wrappers (tests/test_neuron_upstream.py); never run on
Inferentia hardware here.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pipeline.contracts.bucket import Bucket
from pipeline.errors import InputError, PipelineError, RuntimeMismatchError
from pipeline.install.installed import InstalledRelease
from pipeline.plan.checkpoint import read_config, read_shape
from pipeline.plan.config import DTYPE_BYTES
from pipeline.plan.gqa import GqaPlan
from pipeline.plan.instances import INSTANCES
from pipeline.plan.memory import bucket_cost, kv_cache_bytes_per_core, weight_bytes_per_core
from pipeline.runtime.neuron_slots import NeuronSlots
from pipeline.runtime.runners import until_eos

INSTALL_HINT = (
    "serve neuron releases on an inf2 (or trn1) host with the Neuron SDK and optimum-neuron: "
    "pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "'optimum-neuron[neuronx]==0.4.5'"
)


def import_optimum_neuron(what: str) -> Any:
    """The ``optimum.neuron`` module, or one line (exit 2) saying what to install where."""
    try:
        import optimum.neuron as module

        module.NeuronModelForCausalLM  # noqa: B018 - the class the runner needs
    except Exception as e:  # ImportError, or the SDK's own import-time failures
        raise RuntimeMismatchError(
            what,
            f"is a neuron release and optimum.neuron cannot be imported here ({type(e).__name__})",
            INSTALL_HINT,
        ) from None
    return module


class NeuronSession:
    """One loaded export: a fixed batch and sequence length, served through ``generate`` or
    as slots (``slots``), one model either way."""

    def __init__(self, model: Any, bucket: Bucket, pad_token_id: int) -> None:
        self.model: Any = model  # None once unloaded
        self.bucket = bucket
        self.batch = bucket.batch
        self.seq = bucket.seq
        self.pad_token_id = pad_token_id
        self._slots: NeuronSlots | None = None

    @property
    def slots(self) -> NeuronSlots:
        """The export's slot engine, made on first use, on this session's model."""
        if self.model is None:
            raise PipelineError(f"bucket {self.bucket.name}", "was unloaded", None)
        if self._slots is None:
            self._slots = NeuronSlots(self.model, self.bucket)
        return self._slots

    @property
    def busy(self) -> bool:
        """Whether slots of this bucket hold requests (then it must stay loaded)."""
        return self._slots is not None and bool(self._slots.active)

    def close(self) -> None:
        """Drop the model (its device memory goes with the last reference), also from the
        slot engine, so that a caller still holding either cannot keep it alive."""
        self.model = None
        if self._slots is not None:
            self._slots.close()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None
    ) -> list[list[int]]:
        """Greedy: the new tokens of each prompt, up to and including EOS."""
        import torch

        if self.model is None:
            raise PipelineError(f"bucket {self.bucket.name}", "was unloaded", None)
        if self.busy:
            # generate() prefills and decodes every cache line (seq_ids 0..n-1, the rest
            # padded: generation_utils.py:141-142, decoder_wrappers.py:53-88).
            raise PipelineError(
                f"bucket {self.bucket.name}",
                f"has active slots {self.slots.active}: generate() would overwrite their KV caches",
                "free them first",
            )
        n = len(prompts)
        if not 0 < n <= self.batch:
            raise InputError(f"batch of {n}", f"does not fit this bucket's batch {self.batch}")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.seq:
            raise InputError(
                f"prompt of {longest} tokens + {max_new_tokens} new",
                f"exceeds this bucket's sequence length {self.seq}",
                "pick a larger bucket",
            )
        # The export's batch is fixed: pad it up with copies of a real prompt (a row of
        # padding alone is no valid input), then drop those rows.
        rows = [list(p) for p in prompts] + [list(prompts[0])] * (self.batch - n)
        ids = torch.full((self.batch, longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((self.batch, longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        out = self.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        new = out[:n, longest:].tolist()
        return [until_eos(row[:max_new_tokens], eos_token_id) for row in new]


class NeuronRunner:
    """Loads a release's buckets lazily within ``hbm_budget`` bytes per NeuronCore (default:
    the instance's HBM per core), unloading the least recently used that has no active slots.

    A bucket whose slots hold requests is never evicted (its requests' caches live on the
    device): when the room a bucket needs is held by such buckets, loading it fails (exit 1,
    retriable once their slots are freed) and nothing is evicted. An unloaded bucket's
    session and slots refuse further calls; ``slots(bucket)`` then loads it afresh."""

    device = "neuron"

    def __init__(
        self,
        installed: InstalledRelease,
        *,
        hbm_budget: int | None = None,
        cuda_graphs: bool = True,  # accepted for the common interface; nothing to graph
    ) -> None:
        manifest = installed.manifest
        module = import_optimum_neuron(installed.what)
        built = manifest.versions.get("optimum-neuron")
        have = getattr(module, "__version__", None)
        # Loading raises unless the versions are equal (configuration_utils.py:229-233): say
        # so now, in one line, rather than on the first request.
        if built and have and built != have:
            raise RuntimeMismatchError(
                installed.what,
                f"was exported with optimum-neuron {built}, this host has {have}",
                f"install optimum-neuron=={built} or recompile the release",
            )
        self.installed = installed
        self.model_cls = module.NeuronModelForCausalLM
        self.costs = bucket_costs(installed)
        if hbm_budget is None:
            instance = INSTANCES.get(str(manifest.target.get("instance_type")))
            if instance is None:
                raise RuntimeMismatchError(
                    installed.what,
                    f"targets instance type {manifest.target.get('instance_type')!r}, whose HBM "
                    "this inf2-pipeline does not know",
                    "pass hbm_budget (bytes per NeuronCore)",
                )
            hbm_budget = instance.hbm_per_core
        self.budget = hbm_budget
        config = read_config(installed.dir)
        pad = config.get("pad_token_id")
        self.pad_token_id = int(pad if pad is not None else 0)
        self._loaded: OrderedDict[Bucket, NeuronSession] = OrderedDict()  # least recent first

    @property
    def loaded(self) -> list[Bucket]:
        """The loaded buckets, least recently used first."""
        return list(self._loaded)

    @property
    def used(self) -> int:
        return sum(self.costs[b] for b in self._loaded)

    def tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # The export's sequence length bounds the prompt and every generated token.
        return prompt_len + max_new_tokens

    def warmup(self, buckets: Sequence[Bucket]) -> None:
        """Load the buckets that fit beside those loaded, in order, evicting none."""
        for bucket in buckets:
            if bucket not in self._loaded and self.used + self.costs[bucket] <= self.budget:
                self.session(bucket)

    def unload(self, bucket: Bucket) -> None:
        session = self._loaded.get(bucket)
        if session is None:
            return
        if session.busy:
            raise PipelineError(
                f"bucket {bucket.name}",
                f"has active slots {session.slots.active}",
                "free them before unloading it",
            )
        del self._loaded[bucket]
        session.close()
        gc.collect()  # the model's device memory goes with its last reference

    def slots(self, bucket: Bucket) -> NeuronSlots:
        """The bucket's slot engine: the same model as ``session(bucket)``, loaded once."""
        return self.session(bucket).slots

    def session(self, bucket: Bucket) -> NeuronSession:
        if bucket in self._loaded:
            self._loaded.move_to_end(bucket)
            return self._loaded[bucket]
        cost = self.costs[bucket]
        if cost > self.budget:
            raise InputError(
                f"bucket {bucket.name}",
                f"needs {cost} bytes per NeuronCore, more than the HBM budget ({self.budget})",
                "raise the budget, raise tp_degree, or drop the bucket",
            )
        # Least recently used first, skipping buckets with active slots; nothing is evicted
        # unless that makes room.
        idle = [b for b, s in self._loaded.items() if not s.busy]
        room = self.budget - self.used
        victims: list[Bucket] = []
        while room < cost and idle:
            victims.append(idle.pop(0))
            room += self.costs[victims[-1]]
        if room < cost:
            busy = [b.name for b, s in self._loaded.items() if s.busy]
            raise PipelineError(
                f"bucket {bucket.name}",
                f"needs {cost} bytes per NeuronCore and buckets with active slots "
                f"({', '.join(busy)}) hold the rest of the HBM budget ({self.budget})",
                "retry once their slots are freed",
            )
        for victim in victims:
            self._loaded.pop(victim).close()
        if victims:
            gc.collect()  # the evicted models' device memory goes with their last references
        model = self.model_cls.from_pretrained(str(self.installed.bucket_dir(bucket.name)))
        self._loaded[bucket] = NeuronSession(model, bucket, self.pad_token_id)
        return self._loaded[bucket]


def bucket_costs(installed: InstalledRelease) -> dict[Bucket, int]:
    """Bytes per NeuronCore each bucket takes loaded: ``plan``'s weights copy + KV cache."""
    manifest = installed.manifest
    shape = read_shape(installed.dir)
    gqa = GqaPlan(**manifest.gqa)
    dtype_bytes = DTYPE_BYTES.get(manifest.dtype, 2)
    weights = weight_bytes_per_core(shape, gqa, dtype_bytes)
    return {
        (b := Bucket(e.batch, e.seq)): bucket_cost(
            weights, kv_cache_bytes_per_core(shape, gqa, b, dtype_bytes)
        )
        for e in manifest.buckets.values()
    }
