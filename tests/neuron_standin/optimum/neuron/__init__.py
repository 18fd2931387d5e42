"""A stand-in ``optimum.neuron`` for contract tests: what pipeline.runtime.neuron calls on
optimum-neuron 0.4.5, with the same signatures (tests/test_neuron_upstream.py compares them with
the real classes) and upstream's checks on the inputs, running no model.

Put ``tests/neuron_standin`` first on sys.path to use it. ``NeuronModelForCausalLM``:

* ``from_pretrained(model_id, **kwargs)`` reads the export's neuron_config.json and config.json
  and checks the files a load needs (model.pt, one weights shard per tp rank), as upstream's
  ``_from_pretrained`` does (models/inference/backend/pretrained_model.py:386-443), and the
  recorded optimum-neuron version (configuration_utils.py:229-233). ``neuron_config`` has the
  attributes of upstream's NxDNeuronConfig (its defaults: backend/config.py:54-138), ``config``
  those of config.json;
* ``generate(input_ids, attention_mask=None, generation_config=None, **kwargs)`` refuses what
  upstream's refuses (generation_utils.py:76-139: a batch larger than the export's, an input
  longer than its sequence length, left padding, output_logits/output_scores/
  return_dict_in_generate) and returns the input ids followed by the new tokens, as
  transformers' generate does. The tokens are deterministic: ``NEXT_TOKEN(row, vocab)`` of the
  row's real (unpadded) tokens so far (default ``next_token``), so every bucket gives the same
  tokens for the same prompt. Like upstream's, it overwrites every KV-cache line;
* ``forward(input_ids, position_ids, seq_ids, sampling_params, ...)`` is the model as
  upstream's continuous-batching runtime treats it: the graph it picks, the KV-cache line each
  row reads and writes, the rows upstream adds to a partial decode batch. Each cache position
  remembers the tokens (and positions) it was computed from, so a row that attends a position
  not written for its own sequence (a wrong position, a wrong seq_id, a line overwritten by a
  padding row) is refused instead of answered. The next token is ``NEXT_TOKEN`` of the tokens
  the row attends, so a correct caller gets ``generate``'s tokens. Where upstream would compute
  garbage rather than refuse, this refuses, and says so in a comment.
  tests/test_neuron_upstream.py replays the engine's calls through upstream's real forward.

``CALLS`` records every call (``forward``: route, inputs, what each row attended, tokens);
``LIVE`` holds the loaded models' directories until each model is garbage-collected (what an
unloaded bucket looks like).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

__version__ = "0.4.5"
CALLS: list[tuple[Any, ...]] = []
LIVE: dict[int, str] = {}


def next_token(tokens: list[int], vocab: int) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % vocab


NEXT_TOKEN = next_token  # tests may put a real model's greedy choice here


# What one KV-cache position holds: the (token, position) pairs of the sequence it was computed
# from, or what overwrote it without being a row of that sequence.
Cell = tuple[tuple[int, int], ...] | str | None
PADDING = "the padding of an encoded prompt"  # decoder_wrappers.py:119-124
FOREIGN = "a copy of another row, padding a partial decode batch"  # decoder_wrappers.py:53-88
GENERATE = "a generate() call's row"


class NxDNeuronConfig(SimpleNamespace):
    """The fields of neuron_config.json as upstream's NxDNeuronConfig has them: the bookkeeping
    keys dropped (configuration_utils.py:225-258), upstream's defaults for what is absent
    (backend/config.py:54-138)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        meta = ("_serialized_key", "optimum_neuron_version", "neuronxcc_version")
        given = {k: v for k, v in fields.items() if k not in meta}
        defaults = {
            "batch_size": 1,
            "sequence_length": 128,
            "tp_degree": 1,
            "continuous_batching": False,
            "on_device_sampling": False,
            "max_topk": 256,
            "speculation_length": 0,
            "output_logits": False,
        }
        super().__init__(**{**defaults, **given})
        if getattr(self, "max_batch_size", None) is None:
            self.max_batch_size = self.batch_size
        if getattr(self, "max_context_length", None) is None:
            self.max_context_length = self.sequence_length

    @property
    def ctx_batch_size(self) -> int:
        return 1 if self.continuous_batching else self.batch_size

    @property
    def tkg_batch_size(self) -> int:
        return self.batch_size


def check_sampling_params(params: torch.Tensor, max_topk: int) -> None:
    """What upstream checks of the [top_k, top_p, temperature] rows when the export samples on
    the device (sampling.py:102-146)."""
    if params.dim() != 2 or params.shape[1] != 3:
        raise ValueError(f"sampling_params {tuple(params.shape)}: want [rows, 3]")
    top_k, top_p, temperature = params.to(torch.float32).unbind(1)
    if not torch.all((top_k == -1) | ((top_k > 0) & (top_k <= max_topk))):
        raise ValueError(f"top_k {top_k.tolist()}: each -1 or 1..{max_topk}")
    if not torch.equal(top_k, top_k.floor()):
        raise ValueError(f"top_k {top_k.tolist()}: whole numbers only")
    if not torch.all((top_p > 0.0) & (top_p <= 1.0)):
        raise ValueError(f"top_p {top_p.tolist()}: each in (0, 1]")
    if not torch.all(temperature > 0.0):
        raise ValueError(f"temperature {temperature.tolist()}: each > 0")


class NeuronModelForCausalLM:
    def __init__(self, model_id: str, neuron_config: dict, config: dict) -> None:
        self.model_id = model_id
        self.neuron_config = NxDNeuronConfig(neuron_config)
        self.config = SimpleNamespace(**config)
        nc = self.neuron_config
        # One cache line per sequence of the batch (kv_cache_manager.py:46-63).
        self.cells: list[list[Cell]] = [
            [None] * nc.sequence_length for _ in range(nc.max_batch_size)
        ]
        LIVE[id(self)] = model_id
        weakref.finalize(self, LIVE.pop, id(self), None)

    @classmethod
    def from_pretrained(cls, model_id: str | Path, **kwargs) -> NeuronModelForCausalLM:
        path = Path(model_id)
        CALLS.append(("from_pretrained", str(path), dict(kwargs)))
        nc = json.loads((path / "neuron_config.json").read_text())
        if nc.get("optimum_neuron_version") != __version__:
            raise ValueError(
                f"This model was compiled with optimum-neuron {nc.get('optimum_neuron_version')}"
                f" and cannot be loaded with {__version__}"
            )
        needed = ["model.pt", "config.json"] + [
            f"checkpoint/weights/tp{r}_sharded_checkpoint.safetensors"
            for r in range(nc["tp_degree"])
        ]
        missing = [n for n in needed if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: missing {missing}")
        return cls(str(path), nc, json.loads((path / "config.json").read_text()))

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generation_config: Any | None = None,
        **kwargs,
    ) -> torch.LongTensor:
        CALLS.append(("generate", self.model_id, tuple(input_ids.shape), dict(kwargs)))
        nc = self.neuron_config
        bad = {"output_logits", "output_scores", "return_dict_in_generate"} & {
            k for k, v in kwargs.items() if v
        }
        if bad:
            raise ValueError(f"{sorted(bad)} not supported with on-device sampling")
        batch, length = input_ids.shape
        if batch > nc.batch_size:
            raise ValueError(f"batch {batch} > the export's {nc.batch_size}")
        if length > nc.sequence_length:
            raise ValueError(f"input length {length} > {nc.sequence_length}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.tolist()
        if any(row[0] == 0 and any(row) for row in mask):
            raise ValueError("Left padding is not supported")
        if any(row != sorted(row, reverse=True) for row in mask):
            raise ValueError("attention_mask is not right padding")
        max_new = int(kwargs.get("max_new_tokens", 20))
        eos = kwargs.get("eos_token_id")
        pad = kwargs.get("pad_token_id") or 0
        vocab = int(self.config.vocab_size)
        new = []
        for ids, m in zip(input_ids.tolist(), mask, strict=True):
            row = ids[: sum(m)]
            if len(row) + max_new > nc.sequence_length:
                raise ValueError("prompt + max_new_tokens exceeds the sequence length")
            out: list[int] = []
            while len(out) < max_new and not (out and eos is not None and out[-1] == eos):
                out.append(NEXT_TOKEN(row + out, vocab))
            new.append(out + [pad] * (max_new - len(out)))
        # Upstream's generate prefills rows 0..n-1 and decodes with the other lines padded
        # (generation_utils.py:141-142; decoder_wrappers.py:53-88): every line is overwritten.
        for line in self.cells:
            line[:] = [GENERATE] * len(line)
        # transformers' generate: the (padded) input, then the new tokens.
        return torch.cat([input_ids, torch.tensor(new, dtype=input_ids.dtype)], dim=1)

    def forward(
        self,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        seq_ids: torch.LongTensor | None = None,
        sampling_params: torch.FloatTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> torch.Tensor:
        """Upstream's NxDModelForCausalLM.forward (backend/modules/decoder/modeling_decoder.py:
        361-405) with its graph wrappers (decoder_wrappers.py) and KV cache
        (kv_cache_manager.py). One token per row where the export samples on the device,
        else logits [rows, 1, vocab] (1.0 at the token, 0 elsewhere)."""
        nc = self.neuron_config
        flags = {
            "output_attentions": output_attentions,
            "output_hidden_states": output_hidden_states,
            "return_dict": return_dict,
        }
        for name, flag in flags.items():
            if flag:  # modeling_decoder.py:371-376
                raise ValueError(f"{name}: refused by the neuron model")
        # Stricter than upstream from here to the sampling parameters: its graphs have static
        # shapes and integer inputs (decoder_wrappers.py:108-116), so these would fail on the
        # device or pick wrong cache lines.
        if input_ids.dim() != 2 or tuple(position_ids.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and position_ids "
                f"{tuple(position_ids.shape)} must be [rows, tokens], the same shape"
            )
        if input_ids.dtype.is_floating_point or position_ids.dtype.is_floating_point:
            raise ValueError("input_ids and position_ids must be integer tensors")
        if seq_ids is None or seq_ids.dim() != 1 or seq_ids.shape[0] != input_ids.shape[0]:
            raise ValueError("seq_ids must give one cache line per row")
        rows = [int(s) for s in seq_ids.tolist()]
        if len(rows) > nc.max_batch_size:  # decoder_wrappers.py:126-131
            raise ValueError(f"{len(rows)} rows for an export of {nc.max_batch_size} lines")
        if len(set(rows)) != len(rows) or not all(0 <= s < nc.max_batch_size for s in rows):
            # Upstream sorts and pads seq_ids into a permutation of the cache lines
            # (decoder_wrappers.py:70-79, 90-106): these would pick wrong lines.
            raise ValueError(f"seq_ids {rows}: distinct cache lines 0..{nc.max_batch_size - 1}")
        if sampling_params is None or sampling_params.shape[0] != len(rows):
            raise ValueError("sampling_params must have one row per input row")
        if nc.on_device_sampling:  # modeling_decoder.py:377-378
            check_sampling_params(sampling_params, nc.max_topk)
        ids, pos = input_ids.tolist(), position_ids.tolist()
        if input_ids.shape[-1] > 1 and not position_ids.min().item():  # modeling_decoder.py:380
            route = "context_encoding"
            if input_ids.shape[-1] > nc.max_context_length:
                # Stricter: upstream pads by a negative length, cropping the prompt silently
                # (decoder_wrappers.py:119-124).
                raise ValueError(
                    f"input of {input_ids.shape[-1]} tokens > the context length "
                    f"{nc.max_context_length}"
                )
            # Continuous batching encodes one row per graph call, into line seq_ids[0]
            # (decoder_wrappers.py:143-156; kv_cache_manager.py:130-146); without it, the
            # rows fill the lines in order (kv_cache_manager.py:147-149).
            attended = [
                self._encode(line if nc.continuous_batching else r, ids[r], pos[r])
                for r, line in enumerate(rows)
            ]
        elif nc.speculation_length and input_ids.shape[-1] == nc.speculation_length:
            raise NotImplementedError("speculation: not part of these exports")
        else:
            route = "token_generation"
            if input_ids.shape[-1] != 1:  # its graph is traced for one token a row
                raise ValueError(
                    f"rows of {input_ids.shape[-1]} tokens from position "
                    f"{position_ids.min().item()} > 0: the token-generation graph takes one"
                )
            attended = self._decode(rows, [r[0] for r in ids], [p[0] for p in pos])
        vocab = int(self.config.vocab_size)
        tokens = [NEXT_TOKEN([t for t, _ in a], vocab) for a in attended]
        inputs = {"input_ids": ids, "position_ids": pos, "seq_ids": rows}
        inputs["sampling_params"] = sampling_params.tolist()
        CALLS.append(("forward", self.model_id, route, inputs, attended, tokens))
        if nc.on_device_sampling:  # sampled on the device: one token per row
            return torch.tensor(tokens, dtype=torch.long)
        logits = torch.zeros((len(rows), 1, vocab), dtype=torch.float32)
        logits[torch.arange(len(rows)), 0, torch.tensor(tokens)] = 1.0
        return logits

    def _encode(self, line: int, ids: list[int], pos: list[int]) -> tuple[tuple[int, int], ...]:
        """The context-encoding graph on one row: what the next token attends."""
        nc = self.neuron_config
        # Padded to the context length: ids with the pad token (0 where config.json has none),
        # positions with 1 (decoder_wrappers.py:50-51, 119-124).
        width = nc.max_context_length
        pad = getattr(self.config, "pad_token_id", None) or 0
        ids = ids + [pad] * (width - len(ids))
        pos = pos + [1] * (width - len(pos))
        # The logits are the row's at its largest position id, the first one
        # (modeling_decoder.py:224-229).
        end = pos.index(max(pos)) + 1
        if pos[:end] != list(range(end)):
            # Stricter: upstream would encode the tokens at those positions.
            raise ValueError(f"prompt positions {pos[:end]} are not 0..{end - 1}")
        pairs = tuple(zip(ids, pos, strict=True))
        # The whole padded row goes into the line (kv_cache_manager.py:130-146).
        self.cells[line][:width] = [pairs[: q + 1] for q in range(end)] + [PADDING] * (width - end)
        return pairs[:end]

    def _decode(
        self, rows: list[int], tokens: list[int], positions: list[int]
    ) -> list[tuple[tuple[int, int], ...]]:
        """The token-generation graph: the wrapper sorts the rows by seq_id and gives the lines
        not in ``rows`` copies of the first row (decoder_wrappers.py:53-106), and row i reads
        and writes line i at its position (kv_cache_manager.py:150-154)."""
        nc = self.neuron_config
        attended = [self._attend(*row) for row in zip(rows, tokens, positions, strict=True)]
        if len(rows) < nc.batch_size:
            for line in set(range(nc.max_batch_size)) - set(rows):
                if 0 <= positions[0] < nc.sequence_length:
                    self.cells[line][positions[0]] = FOREIGN
        return attended

    def _attend(self, line: int, token: int, p: int) -> tuple[tuple[int, int], ...]:
        """One real decode row: refused unless cache positions 0..p-1 of ``line`` were all
        written for one sequence, in order; then position p is written."""
        cells = self.cells[line]
        if not 0 <= p < len(cells):
            raise ValueError(f"position {p} is outside the KV cache of {len(cells)} positions")
        prefix = cells[p - 1] if p else ()
        if not isinstance(prefix, tuple):
            bad: int | None = p - 1
        else:
            bad = next((q for q in range(p) if cells[q] != prefix[: q + 1]), None)
        if bad is not None:
            held = cells[bad]
            what = (
                "nothing written"
                if held is None
                else held
                if isinstance(held, str)
                else "an entry computed from other tokens"
            )
            raise ValueError(
                f"seq_id {line}, position {p}: does not continue its sequence (cache position "
                f"{bad} holds {what})"
            )
        cells[p] = (*prefix, (token, p))
        return cells[p]
