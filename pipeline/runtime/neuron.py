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
import logging
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
from pipeline.runtime.sampling import SamplingParams, SlotSampling, draw

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


# Greedy as optimum-neuron spells it, one row per sequence: top_k 1, top_p 1.0, temperature
# 1.0 (vLLM's temperature 0 becomes this: vllm/runner.py:47-52; upstream's own default:
# sampling.py:149-164). Rows are [top_k, top_p, temperature], float32 (vllm/runner.py:253-264),
# and must pass sampling.py:102-146 where sampling is on the device (modeling_decoder.py:377).
GREEDY = (1.0, 1.0, 1.0)
log = logging.getLogger("inf2_pipeline.runtime")


class NeuronSlots:
    """One loaded export as ``batch`` KV-cache slots (``pipeline.runtime.runners.Slots``).

    Exports of batch > 1 are continuous-batching models (modeling_llama.py:351,
    modeling_qwen2.py:117): cache line i holds sequence ``seq_id`` i, and the engine calls
    ``forward(input_ids, position_ids, seq_ids, sampling_params)`` as upstream's vLLM runner
    does (vllm/model_loader.py:170-188). Which graph runs follows from the inputs
    (modeling_decoder.py:380-403): more than one token a row with positions from 0 is context
    encoding, one token a row is token generation.

    * Prefill (prompt of 2+ tokens): one row, ``[1, L]`` ids, positions ``0..L-1``, the slot as
      ``seq_ids`` (vllm/runner.py:379-401), unpadded: upstream pads it to the export's sequence
      length itself (decoder_wrappers.py:119-124) and, under continuous batching, encodes one
      row per graph call (config.py:132-134; decoder_wrappers.py:143-156) and writes that
      slot's cache line only (kv_cache_manager.py:130-146).
    * Decode: ``[n, 1]`` ids (each slot's last token) at ``[n, 1]`` positions (the number of
      tokens it holds minus one: vllm/runner.py:431-442), rows sorted by ``seq_ids``
      (vllm/model_loader.py:177-188). The graph always runs the export's whole batch, row i
      on cache line i (kv_cache_manager.py:150-154; decoder_wrappers.py:90-106); upstream
      fills the slots not given with copies of the first row (decoder_wrappers.py:53-88),
      which overwrites a cache position of every active slot left out. So every decode call
      here carries every active slot: those not asked for are fed their pending token at
      their pending position again, rewriting the same cache entry, and their output is
      dropped. A step of some slots costs what a step of all costs.
    * A one-token prompt goes to the token-generation graph too (modeling_decoder.py:380), as a
      decode row at position 0, with the other active slots beside it for the same reason.
    * Output: one token per row where the export samples on the device (sampling.py:306;
      generation_utils.py:168-169), greedy with ``GREEDY``; otherwise logits, whose last
      position (vllm/model_loader.py:189-191) is reduced to its argmax here on the host, as
      vLLM's sampler does when every row is greedy, top_k 1 (vllm/runner.py:130-134,
      vllm/sampler.py:32-37). Qwen2/Qwen3 exports of batch > 1 at tp 2 are such
      (modeling_qwen2.py:117-125, modeling_qwen3.py:139-147).

    A slot holds its prompt and every token generated, at most ``seq`` (the export's cache
    length): a prefill needs ``len(prompt) + 1 <= seq``, a step one more free position. Bad
    calls raise ``InputError`` (a ValueError) before anything runs.
    """

    def __init__(self, model: Any, bucket: Bucket) -> None:
        nc = model.neuron_config
        if (nc.batch_size, nc.sequence_length) != (bucket.batch, bucket.seq):
            raise RuntimeMismatchError(
                f"bucket {bucket.name}",
                f"holds an export of batch {nc.batch_size}, sequence length {nc.sequence_length}",
                "recompile the release",
            )
        if bucket.batch > 1 and not nc.continuous_batching:
            # Without it, context encoding fills every cache line at once
            # (kv_cache_manager.py:147-149): rows are no independent slots.
            raise RuntimeMismatchError(
                f"bucket {bucket.name}",
                "is an export without continuous batching: its rows cannot be served as slots",
                "export it with optimum-neuron's defaults (batch > 1 turns it on)",
            )
        self.model: Any = model  # None once the runner unloads the bucket
        self.name = bucket.name
        self.batch = bucket.batch
        self.seq = bucket.seq
        self.on_device_sampling = bool(nc.on_device_sampling)
        # the largest top_k the device sampler takes (config.py:73, default 256); on the host
        # any k up to the vocabulary (vllm/runner.py:253-258)
        self.max_topk = int(getattr(nc, "max_topk", 0) or 0) if self.on_device_sampling else 0
        if not self.on_device_sampling:  # e.g. Qwen2/3 at tp 2 under continuous batching
            log.info(
                "bucket %s: the export returns logits (no on-device sampling, "
                "modeling_qwen2.py:117-125): tokens are picked on the host, greedy or sampled",
                bucket.name,
            )
        # Slots that sample (the rest are greedy); its counters serve the host sampler (the
        # device keeps its own generator).
        self._sampling = SlotSampling()
        # Each active slot: the token it produced last and the position it goes in (the
        # number of tokens the slot holds, minus one).
        self._pending: dict[int, tuple[int, int]] = {}

    @property
    def active(self) -> list[int]:
        """The slots holding a request, in order."""
        return sorted(self._pending)

    @property
    def seeded(self) -> bool:
        """Whether a request's ``seed`` decides its tokens: only where this runner samples on
        the host. The device sampler has one generator for the whole export, and upstream's
        own vLLM runner passes no per-request generators either (vllm/runner.py:184)."""
        return not self.on_device_sampling

    def prefill(
        self, slot: int, prompt: Sequence[int], sampling: SamplingParams | None = None
    ) -> int:
        self._check_slot(slot)
        tokens = [int(t) for t in prompt]
        if not 0 < len(tokens) < self.seq:
            raise InputError(
                f"prompt of {len(tokens)} tokens",
                f"does not fit slot {slot}: 1..{self.seq - 1} tokens leave room for the first "
                f"new one in this bucket's {self.seq} positions",
                "pick a larger bucket" if tokens else None,
            )
        self._pending.pop(slot, None)  # replacing the slot's request, whatever happens next
        self._sampling.assign(slot, sampling)
        if len(tokens) == 1:
            token = self._decode({slot: (tokens[0], 0)})[slot]
        else:
            (token,) = self._forward([tokens], [list(range(len(tokens)))], [slot], {slot})
        self._pending[slot] = (token, len(tokens))
        return token

    def step(self, slots: Sequence[int]) -> list[int]:
        order = [int(s) for s in slots]
        if not order or len(set(order)) != len(order):
            raise InputError(f"slots {order}", "must be one or more distinct slots", None)
        for slot in order:
            self._check_slot(slot)
            if slot not in self._pending:
                raise InputError(f"slot {slot}", "is not active", "prefill it first")
            if self._pending[slot][1] + 1 >= self.seq:
                raise InputError(
                    f"slot {slot}",
                    f"holds {self._pending[slot][1] + 1} tokens: one more would exceed this "
                    f"bucket's {self.seq} positions",
                    "free it; its request needed a larger bucket",
                )
        out = self._decode({s: self._pending[s] for s in order})
        for slot in order:
            self._pending[slot] = (out[slot], self._pending[slot][1] + 1)
        return [out[s] for s in order]

    def free(self, slot: int) -> None:
        """Forget the slot's request (nothing runs; the next prefill rewrites its cache line).
        Freeing a free slot does nothing."""
        self._check_slot(slot)
        self._pending.pop(slot, None)
        self._sampling.free(slot)

    def close(self) -> None:
        """The bucket is unloaded: drop the model and every request; later calls refuse."""
        self.model = None
        self._pending.clear()

    def _check_slot(self, slot: int) -> None:
        if self.model is None:
            raise PipelineError(
                f"bucket {self.name}",
                "was unloaded (evicted to make room for another bucket)",
                "get its slots again from the runner",
            )
        if not 0 <= slot < self.batch:
            raise InputError(f"slot {slot}", f"outside this bucket's batch {self.batch}", None)

    def _decode(self, rows: dict[int, tuple[int, int]]) -> dict[int, int]:
        """One token-generation call: ``rows`` (slot: token, position) and every other active
        slot at its pending token and position (see the class docstring). The next token of
        each slot of ``rows``."""
        feed = {**self._pending, **rows}
        order = sorted(feed)
        feed_ids = [[feed[s][0]] for s in order]
        tokens = self._forward(feed_ids, [[feed[s][1]] for s in order], order, set(rows))
        return {s: t for s, t in zip(order, tokens, strict=True) if s in rows}

    def sampling_row(self, params: SamplingParams) -> tuple[float, float, float]:
        """One row of ``sampling_params`` as optimum-neuron takes it: [top_k, top_p,
        temperature] (sampling.py:149-164), valid for validate_sampling_params
        (sampling.py:102-146): greedy as ``GREEDY``; top_k 0 (every token) as the largest
        the device takes, and larger ones clamped to it, as vllm/runner.py:253-263 does."""
        if params.greedy:
            return GREEDY
        if not self.on_device_sampling:  # the host samples; the row only has to be valid
            return (float(params.top_k or -1), params.top_p, params.temperature)
        top_k = min(params.top_k or self.max_topk, self.max_topk)
        return (float(top_k), params.top_p, params.temperature)

    def _forward(
        self,
        input_ids: list[list[int]],
        position_ids: list[list[int]],
        seq_ids: list[int],
        wanted: set[int],
    ) -> list[int]:
        """One forward call; the next token of each row (only those of ``wanted`` slots are
        drawn where the host samples, so a row fed again does not advance its counter)."""
        import torch

        rows = [self.sampling_row(self._sampling.params(s)) for s in seq_ids]
        with torch.inference_mode():  # as upstream's runner calls it (vllm/runner.py:266)
            out = self.model.forward(
                input_ids=torch.tensor(input_ids, dtype=torch.long),
                position_ids=torch.tensor(position_ids, dtype=torch.long),
                seq_ids=torch.tensor(seq_ids, dtype=torch.long),
                sampling_params=torch.tensor(rows, dtype=torch.float32),
            )
        if self.on_device_sampling:
            return [int(t) for t in out.reshape(-1).tolist()]
        # Logits [rows, 1, vocab]; padded vocabulary columns are masked to the lowest value
        # (modeling_decoder.py:244-245), so the argmax is a real token, and a draw too.
        logits = out[:, -1, :]
        tokens = logits.argmax(dim=-1)
        slots = self._sampling.sampled([s for s in seq_ids if s in wanted])
        if slots:
            drawn = [seq_ids.index(s) for s in slots]
            tokens[drawn] = draw(logits[drawn], self._sampling.draws(slots, logits.device))
        return [int(t) for t in tokens.tolist()]


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
        return [_until(row[:max_new_tokens], eos_token_id) for row in new]


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


def _until(row: list[int], eos: int | None) -> list[int]:
    return row[: row.index(eos) + 1] if eos is not None and eos in row else row
