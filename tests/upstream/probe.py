"""Run by the side environment's interpreter (optimum-neuron 0.4.5, no Neuron SDK): asks
upstream's own code what the pipeline needs to agree with, in one process (its imports take
most of the time). Imports upstream code only, never the pipeline.

stdin, JSON: {"argv": [argv lists of ``optimum-cli export neuron ...``],
              "neuron_config": [[checkpoint dir, instance type, batch, seq, tp], ...]}
stdout, JSON: {"parsed": [namespace fields, or the parser's error, per argv],
               "decoders": [registered text-generation model types], "mistral": bool,
               "signatures": {"from_pretrained": ..., "generate": ..., ...},
               "neuron_config": [what get_neuron_config makes of each checkpoint]}
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
    }
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
