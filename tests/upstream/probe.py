"""Run by the side environment's interpreter (optimum-neuron 0.4.5, no Neuron SDK): asks
upstream's own code what the pipeline needs to agree with, in one process (its imports take
most of the time). Imports upstream code only, never the pipeline.

stdin, JSON: {"argv": [argv lists of ``optimum-cli export neuron ...``],
              "neuron_config": [[checkpoint dir, instance type, batch, seq, tp], ...],
              "config_fields": [neuron_config.json contents, ...],
              "sampling": {"rows": [[top_k, top_p, temperature], ...], "max_topk": int},
              "replay": [{"neuron_config": {...}, "pad_token_id": int | None,
                          "calls": [{"input_ids", "position_ids", "seq_ids",
                                     "sampling_params"}, ...]}, ...]}
stdout, JSON: {"parsed": [namespace fields, or the parser's error, per argv],
               "decoders": [registered text-generation model types], "mistral": bool,
               "signatures": {"from_pretrained": ..., "generate": ..., "forward": ..., ...},
               "neuron_config": [what get_neuron_config makes of each checkpoint],
               "config_fields": [the NxDNeuronConfig attributes a caller reads, per contents],
               "sampling": {"error": str | None, "default": prepare_sampling_params's rows},
               "replay": [[per call: {"route", "rows": [{"attended", "consistent"}],
                                      "graph": [{"tag", "seq_ids"}]}, ...], ...]}
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import sys

FIELDS = ("model", "output", "task", "instance_type", "tensor_parallel_size", "batch_size",
          "sequence_length", "torch_dtype", "auto_cast", "auto_cast_type")  # fmt: skip


def parse(argv: list[str]) -> dict:
    """The namespace of the real ``optimum-cli export neuron`` parser. The parser is built
    by parse_args_neuronx (optimum/commands/export/neuronx.py:28); the ``neuron`` subcommand
    itself registers only where torch_neuronx imports, so it is called directly."""
    from optimum.commands.export.neuronx import parse_args_neuronx

    assert argv[:3] == ["optimum-cli", "export", "neuron"], argv
    parser = argparse.ArgumentParser("optimum-cli export neuron")
    parse_args_neuronx(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv[3:])
    except SystemExit as e:
        return {"error": err.getvalue().strip().splitlines()[-1], "code": e.code}
    return {k: str(getattr(ns, k)) if k == "output" else getattr(ns, k) for k in FIELDS}


def describe(fn) -> list:
    return [
        [p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
        for p in inspect.signature(fn).parameters.values()
    ]


# The NxDNeuronConfig attributes that a caller of the model reads (the slot engine and the
# stand-in): compared with the stand-in's.
CONFIG_ATTRIBUTES = ("batch_size", "sequence_length", "max_batch_size", "max_context_length",
                     "ctx_batch_size", "tkg_batch_size", "continuous_batching",
                     "on_device_sampling", "max_topk", "speculation_length")  # fmt: skip


def neuron_config_of(fields: dict):
    """What upstream's loader makes of neuron_config.json: NeuronConfig.from_dict drops the
    three bookkeeping keys (after checking the versions) and calls the class with the rest
    (optimum/neuron/configuration_utils.py:225-258)."""
    from optimum.neuron.models.inference.backend.config import NxDNeuronConfig

    meta = ("_serialized_key", "optimum_neuron_version", "neuronxcc_version")
    return NxDNeuronConfig(**{k: v for k, v in fields.items() if k not in meta})


class FakeGraphs:
    """Traced graphs that keep the KV cache as kv_cache_manager.py's update_cache does:
    context encoding writes line seq_ids[0] under continuous batching, else the lines in row
    order (:130-149); token generation writes row i into line i at its position (:150-154).
    Each cache position keeps the (token, position) pairs it was computed from. A graph answers
    each row with the index of what it attended in ``attended``, with whether every position
    it attended was computed for the sequence it continues ("consistent")."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.cells: list[list] = [[None] * nc.sequence_length for _ in range(nc.max_batch_size)]
        self.attended: list[tuple[tuple, bool]] = []
        self.calls: list[dict] = []

    def graph(self, tag: str):
        def run(input_ids, position_ids, seq_ids, sampling_params):
            import torch

            self.calls.append({"tag": tag, "seq_ids": seq_ids.tolist()})
            ids, pos, lines = input_ids.tolist(), position_ids.tolist(), seq_ids.tolist()
            found = []
            for r in range(len(ids)):
                if tag == "context_encoding_model":  # decoder_wrappers.py:27
                    line = lines[r] if self.nc.continuous_batching else r
                    pairs = tuple(zip(ids[r], pos[r], strict=True))
                    self.cells[line][: len(pairs)] = [pairs[: q + 1] for q in range(len(pairs))]
                    # The logits are the row's at its largest position (modeling_decoder.py:226).
                    end = int(torch.max(position_ids[r : r + 1], dim=1).indices) + 1
                    seen, ok = pairs[:end], True
                else:
                    line, p = r, pos[r][0]
                    prefix = self.cells[line][p - 1] if p else ()
                    ok = isinstance(prefix, tuple) and all(
                        self.cells[line][q] == prefix[: q + 1] for q in range(p)
                    )
                    seen = (*(prefix if ok else ()), (ids[r][0], p))
                    self.cells[line][p] = seen
                self.attended.append((seen, ok))
                found.append(len(self.attended) - 1)
            return torch.tensor(found)

        return run


def replay(scenario: dict) -> list[dict]:
    """A scenario's forward calls through upstream's real NxDModelForCausalLM.forward and
    NxDDecoderWrapperForCausalLM (which pick the graph, pad, split and reorder the rows), onto
    ``FakeGraphs`` with an empty KV cache."""
    from types import SimpleNamespace

    import torch
    from optimum.neuron.models.inference.backend.modules.decoder import decoder_wrappers as dw
    from optimum.neuron.models.inference.backend.modules.decoder.modeling_decoder import (
        NxDModelForCausalLM as Model,
    )

    CTX, TKG, Wrapper = (
        dw.CONTEXT_ENCODING_MODEL_TAG,
        dw.TOKEN_GENERATION_MODEL_TAG,
        dw.NxDDecoderWrapperForCausalLM,
    )

    nc = neuron_config_of(scenario["neuron_config"])
    config = SimpleNamespace(pad_token_id=scenario.get("pad_token_id"))
    graphs = FakeGraphs(nc)
    model = SimpleNamespace(  # what forward reads of its model (modeling_decoder.py:361-405)
        neuron_config=nc,
        kv_cache_populated=False,
        context_encoding_model=Wrapper(
            config, Model._create_context_encoding_config(nc), graphs.graph(CTX), CTX
        ),
        token_generation_model=Wrapper(
            config, Model._create_token_generation_config(nc), graphs.graph(TKG), TKG
        ),
    )
    results = []
    for call in scenario["calls"]:
        graphs.calls.clear()
        answers = Model.forward(
            model,
            input_ids=torch.tensor(call["input_ids"], dtype=torch.long),
            position_ids=torch.tensor(call["position_ids"], dtype=torch.long),
            seq_ids=torch.tensor(call["seq_ids"], dtype=torch.long),
            sampling_params=torch.tensor(call["sampling_params"], dtype=torch.float32),
        )
        rows = [graphs.attended[i] for i in answers.tolist()]
        tags = sorted({g["tag"] for g in graphs.calls})
        results.append(
            {
                "route": tags[0].removesuffix("_model") if len(tags) == 1 else tags,
                "rows": [{"attended": [list(p) for p in a], "consistent": ok} for a, ok in rows],
                "graph": list(graphs.calls),
            }
        )
    return results


def main() -> None:
    request = json.load(sys.stdin)
    # The parser first, before the SDK stubs exist: exactly what a build host without the
    # Neuron SDK's device sees.
    out: dict = {"parsed": [parse(a) for a in request.get("argv", [])]}

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sdk_stubs  # noqa: F401
    from optimum.neuron import NeuronModelForCausalLM
    from optimum.neuron.models.auto_model import (
        _REGISTERED_NEURON_MODELS,
        get_neuron_model_class,
        has_neuron_model_class,
    )
    from transformers import AutoConfig

    # The first lookup imports models/inference/auto_models.py, whose decorators fill the
    # registry (models/auto_model.py:20-35).
    out["mistral"] = has_neuron_model_class("mistral", "text-generation", "inference")
    out["decoders"] = sorted(
        t
        for (t, task, mode) in _REGISTERED_NEURON_MODELS
        if (task, mode) == ("text-generation", "inference")
    )
    # from_pretrained: the abstract class's, which resolves the class from config.model_type
    # (models/inference/modeling_utils.py:196-206); generate: the concrete NxD class's (the
    # abstract one only raises NotImplementedError, modeling_utils.py:378-391).
    llama = get_neuron_model_class("llama", "text-generation", "inference")
    out["signatures"] = {
        "from_pretrained": describe(NeuronModelForCausalLM.from_pretrained),
        "generate": describe(llama.generate),
        "generate_owner": next(c.__qualname__ for c in llama.__mro__ if "generate" in c.__dict__),
        # What the slot engine calls, as upstream's vLLM runner does (vllm/model_loader.py:183).
        "forward": describe(llama.forward),
        "forward_owner": next(c.__qualname__ for c in llama.__mro__ if "forward" in c.__dict__),
    }
    out["config_fields"] = [
        {k: getattr(neuron_config_of(fields), k) for k in CONFIG_ATTRIBUTES}
        for fields in request.get("config_fields", [])
    ]
    if "sampling" in request:
        import torch
        from optimum.neuron.models.inference.backend.modules.generation.sampling import (
            prepare_sampling_params,
            validate_sampling_params,
        )

        rows = request["sampling"]["rows"]
        try:
            validate_sampling_params(torch.tensor(rows), request["sampling"]["max_topk"])
            error = None
        except ValueError as e:
            error = str(e)
        out["sampling"] = {"error": error, "default": prepare_sampling_params(len(rows)).tolist()}
    out["replay"] = [replay(scenario) for scenario in request.get("replay", [])]
    configs = []
    for path, instance, batch, seq, tp in request.get("neuron_config", []):
        config = AutoConfig.from_pretrained(path)
        try:
            # The exporter's first step for a decoder (exporters/neuron/__main__.py:754-763).
            nc = NeuronModelForCausalLM.get_neuron_config(
                path,
                config=config,
                instance_type=instance,
                batch_size=batch,
                sequence_length=seq,
                tensor_parallel_size=tp,
            )
            cls = get_neuron_model_class(config.model_type, "text-generation", "inference")
        except Exception as e:  # e.g. an unregistered model type: the test shows it
            configs.append({"error": f"{type(e).__name__}: {e}"})
            continue
        configs.append(
            {
                "class": cls.__name__,
                "torch_dtype": str(nc.torch_dtype).removeprefix("torch."),
                "batch_size": nc.batch_size,
                "sequence_length": nc.sequence_length,
                "tp_degree": nc.tp_degree,
                "target": nc.target,
            }
        )
    out["neuron_config"] = configs
    print(json.dumps(out))


if __name__ == "__main__":
    main()
