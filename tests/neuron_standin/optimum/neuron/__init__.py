"""A stand-in ``optimum.neuron`` for contract tests: what pipeline.runtime.neuron calls on
optimum-neuron 0.4.5, with the same signatures (tests/test_neuron_upstream.py compares them with
the real classes) and upstream's checks on the inputs, running no model.

Put ``tests/neuron_standin`` first on sys.path to use it. ``NeuronModelForCausalLM``:

* ``from_pretrained(model_id, **kwargs)`` reads the export's neuron_config.json and config.json
  and checks the files a load needs (model.pt, one weights shard per tp rank), as upstream's
  ``_from_pretrained`` does (models/inference/backend/pretrained_model.py:386-443), and the
  recorded optimum-neuron version (configuration_utils.py:229-233);
* ``generate(input_ids, attention_mask=None, generation_config=None, **kwargs)`` refuses what
  upstream's refuses (generation_utils.py:76-139: a batch larger than the export's, an input
  longer than its sequence length, left padding, output_logits/output_scores/
  return_dict_in_generate) and returns the input ids followed by the new tokens, as
  transformers' generate does. The tokens are deterministic: ``NEXT_TOKEN(row, vocab)`` of the
  row's real (unpadded) tokens so far (default ``next_token``), so every bucket gives the same
  tokens for the same prompt.

``CALLS`` records every call; ``LIVE`` holds the loaded models' directories until each model
is garbage-collected (what an unloaded bucket looks like).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import torch

__version__ = "0.4.5"
CALLS: list[tuple[Any, ...]] = []
LIVE: dict[int, str] = {}


def next_token(tokens: list[int], vocab: int) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % vocab


NEXT_TOKEN = next_token  # tests may put a real model's greedy choice here


class NeuronModelForCausalLM:
    def __init__(self, model_id: str, neuron_config: dict, config: dict) -> None:
        self.model_id = model_id
        self.neuron_config = neuron_config
        self.config = config
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
        bad = {"output_logits", "output_scores", "return_dict_in_generate"} & {
            k for k, v in kwargs.items() if v
        }
        if bad:
            raise ValueError(f"{sorted(bad)} not supported with on-device sampling")
        batch, length = input_ids.shape
        if batch > self.neuron_config["batch_size"]:
            raise ValueError(f"batch {batch} > the export's {self.neuron_config['batch_size']}")
        if length > self.neuron_config["sequence_length"]:
            raise ValueError(f"input length {length} > {self.neuron_config['sequence_length']}")
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
        vocab = int(self.config["vocab_size"])
        new = []
        for ids, m in zip(input_ids.tolist(), mask, strict=True):
            row = ids[: sum(m)]
            if len(row) + max_new > self.neuron_config["sequence_length"]:
                raise ValueError("prompt + max_new_tokens exceeds the sequence length")
            out: list[int] = []
            while len(out) < max_new and not (out and eos is not None and out[-1] == eos):
                out.append(NEXT_TOKEN(row + out, vocab))
            new.append(out + [pad] * (max_new - len(out)))
        # transformers' generate: the (padded) input, then the new tokens.
        return torch.cat([input_ids, torch.tensor(new, dtype=input_ids.dtype)], dim=1)
