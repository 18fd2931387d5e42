"""One loaded optimum-neuron export as KV-cache slots: the engine's interface
(``pipeline.runtime.runners.Slots``) over upstream's ``forward(input_ids, position_ids,
seq_ids, sampling_params)``, called as upstream's own vLLM runner calls it. Loading,
the HBM budget and whole-batch generation are ``pipeline.runtime.neuron``'s."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pipeline.contracts.bucket import Bucket
from pipeline.errors import InputError, PipelineError, RuntimeMismatchError
from pipeline.runtime.sampling import SamplingParams, SlotSampling, draw

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
