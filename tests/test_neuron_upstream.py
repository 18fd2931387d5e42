"""The Neuron path against optimum-neuron 0.4.5's own code, run in the side environment
(tests/neuron_upstream.py; ``make test`` builds it): the export argv through upstream's real
parser, the architecture list against its real decoder registry, the stand-in runtime's
signatures and neuron_config against the real classes, the checkpoint the backend hands the
exporter through upstream's get_neuron_config, and the slot engine's ``forward`` calls
replayed through upstream's real forward and graph wrappers. One probe process answers all of
them (module fixture).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from pipeline.compile.backends.base import BucketJob
from pipeline.compile.backends.neuron import export_command, write_export_checkpoint
from pipeline.contracts.bucket import Bucket
from pipeline.plan.checkpoint import NEURON_DECODERS
from pipeline.runtime.neuron_slots import GREEDY, NeuronSlots
from pipeline.runtime.sampling import SamplingParams
from tests.neuron_upstream import run_probe

# (bucket, tp, instance type, the --instance_type upstream must parse)
CASES = [
    (Bucket(1, 128), 1, "inf2.xlarge", "inf2"),
    (Bucket(4, 2048), 2, "inf2.8xlarge", "inf2"),
    (Bucket(8, 4096), 24, "inf2.48xlarge", "inf2"),
    (Bucket(2, 1024), 8, "trn1.32xlarge", "trn1"),
    (Bucket(16, 512), 32, "trn1n.32xlarge", "trn1n"),
    (Bucket(1, 8192), 64, "trn2.48xlarge", "trn2"),
]


# NeuronSlots' sampling_params rows for an export that samples on the device (max_topk 256)
_DEVICE = SimpleNamespace(on_device_sampling=True, max_topk=256)
SAMPLING_ROWS = [
    NeuronSlots.sampling_row(_DEVICE, p)  # type: ignore[arg-type]
    for p in (
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.9, seed=1),
        SamplingParams(temperature=1.3, top_k=40),
        SamplingParams(temperature=0.5, top_k=1000),
        SamplingParams(temperature=0.8, top_k=1),  # greedy: top_k 1
    )
]


def job(bucket: Bucket, tp: int, instance: str, tmp: Path) -> BucketJob:
    return BucketJob(
        model_dir=tmp / "ckpt",
        bucket=bucket,
        tp=tp,
        gqa={},
        dtype="bfloat16",
        flags=("-O2",),
        auto_cast_type="bf16",
        out_dir=tmp / "out" / bucket.name,
        instance_type=instance,
    )


@pytest.fixture(scope="module")
def handed(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints as the backend hands them to the exporter: a tiny Mistral without sliding
    window (fp32) for bf16, and a tiny Llama (fp32) for fp16."""
    from pipeline.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("handed")
    mistral = write_tiny_model(root / "mistral", arch="mistral")
    cfg = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    llama = write_tiny_model(root / "llama")
    return {
        "mistral": write_export_checkpoint(mistral, root / "mistral-export", "bfloat16"),
        "llama": write_export_checkpoint(llama, root / "llama-export", "float16"),
    }


@functools.cache
def standin_module() -> ModuleType:
    """The stand-in optimum.neuron, loaded from its file (not as ``optimum``: no sys.path)."""
    path = Path(__file__).parent / "neuron_standin" / "optimum" / "neuron" / "__init__.py"
    spec = importlib.util.spec_from_file_location("standin_optimum_neuron", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# neuron_config.json as the stand-in exporter writes it (tests/neuron_fakes.py): a batch-4
# export (continuous batching), a batch-1 one (without), and a Qwen2/3 one at tp 2 (no
# sampling on the device: qwen2/modeling_qwen2.py:117-125).
BATCH4 = {"batch_size": 4, "sequence_length": 32, "tp_degree": 2, "torch_dtype": "float32",
          "target": "trn1", "continuous_batching": True, "on_device_sampling": True}  # fmt: skip
BATCH1 = {**BATCH4, "batch_size": 1, "continuous_batching": False}
LOGITS = {**BATCH4, "on_device_sampling": False}
META = {"_serialized_key": "NxDNeuronConfig", "optimum_neuron_version": "0.4.5",
        "neuronxcc_version": "2.21.33363.0+82129205"}  # fmt: skip


def serve_four(slots: NeuronSlots) -> None:
    slots.prefill(2, [5, 6, 7, 8, 9])
    slots.step([2])
    slots.prefill(0, [11])  # one token: the token-generation graph, slot 2 beside it
    slots.step([2, 0])
    slots.prefill(3, [1, 2])
    slots.step([3])  # slots 0 and 2 fed again beside it
    slots.free(2)
    slots.prefill(2, [4, 4, 4])  # a freed slot reused
    slots.step([0, 3, 2])


def serve_one(slots: NeuronSlots) -> None:
    slots.prefill(0, [3, 1, 4])
    slots.step([0])
    slots.step([0])
    slots.prefill(0, [9])  # replaces the request
    slots.step([0])


# The slot engine's scenarios: (neuron_config.json, what the server does).
ENGINE: dict[str, tuple[dict, Callable[[NeuronSlots], None]]] = {
    "four slots": (BATCH4, serve_four),
    "one slot": (BATCH1, serve_one),
    "logits": (LOGITS, serve_four),
}


def call(ids: list[list[int]], positions: list[list[int]], seq_ids: list[int]) -> dict:
    return {
        "input_ids": ids,
        "position_ids": positions,
        "seq_ids": seq_ids,
        "sampling_params": [list(GREEDY)] * len(seq_ids),
    }


SIX = call([[1, 2, 3, 4, 5, 6]], [[0, 1, 2, 3, 4, 5]], [0])
# What upstream's own vLLM runner would send, each ending with slot 0's next decode: a
# one-token prompt prefilled alone (vllm/runner.py:379-401) while slot 0 runs, and a decode of
# slot 1 without slot 0 (vllm/runner.py:413-424 only warns of it).
NAIVE = {
    "a one-token prompt alone": [SIX, call([[7]], [[0]], [1]), call([[60]], [[6]], [0])],
    "a slot left out of a decode": [
        SIX,
        call([[7, 8, 9]], [[0, 1, 2]], [1]),
        call([[50]], [[3]], [1]),
        call([[60]], [[6]], [0]),
    ],
}


def as_tensors(c: dict) -> dict[str, Any]:
    import torch

    return {
        k: torch.tensor(v, dtype=torch.float32 if k == "sampling_params" else torch.long)
        for k, v in c.items()
    }


@pytest.fixture(scope="module")
def engine() -> dict[str, list[tuple]]:
    """Each ENGINE scenario run on the stand-in: its forward calls, as the stand-in recorded
    them (route, inputs, what each row attended, tokens)."""
    module = standin_module()
    out = {}
    for name, (fields, serve) in ENGINE.items():
        model = module.NeuronModelForCausalLM(name, fields, {"vocab_size": 512, "pad_token_id": 0})
        module.CALLS.clear()
        serve(NeuronSlots(model, Bucket(fields["batch_size"], fields["sequence_length"])))
        out[name] = [c for c in module.CALLS if c[0] == "forward"]
    return out


@pytest.fixture(scope="module")
def upstream(handed, engine, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("argv")
    jobs = [job(b, tp, i, tmp) for b, tp, i, _ in CASES]
    argv = [export_command(j, tmp / "ckpt", j.out_dir) for j in jobs]
    no_instance = list(argv[0])
    at = no_instance.index("--instance_type")
    del no_instance[at : at + 2]
    return run_probe(
        {
            "argv": [*argv, no_instance],
            "neuron_config": [
                [str(handed["mistral"]), "inf2", 4, 256, 2],
                [str(handed["llama"]), "trn1", 1, 128, 8],
            ],
            "config_fields": [{**fields, **META} for fields in (BATCH4, BATCH1, LOGITS)],
            "sampling": {"rows": [list(r) for r in SAMPLING_ROWS], "max_topk": 256},
            "replay": [
                {
                    "neuron_config": fields,
                    "pad_token_id": 0,
                    "calls": [c[3] for c in engine[name]],
                }
                for name, (fields, _) in ENGINE.items()
            ]
            + [
                {"neuron_config": BATCH4, "pad_token_id": 0, "calls": calls}
                for calls in NAIVE.values()
            ],
        }
    )


def test_export_argv_is_what_upstreams_parser_expects(upstream, tmp_path):
    parsed = upstream["parsed"]
    for (bucket, tp, instance, family), got in zip(CASES, parsed, strict=False):
        assert "error" not in got, (instance, got)
        assert got["task"] == "text-generation"
        assert got["batch_size"] == bucket.batch
        assert got["sequence_length"] == bucket.seq
        assert got["tensor_parallel_size"] == tp
        assert got["instance_type"] == family
        assert got["model"].endswith("/ckpt")
        assert got["output"].endswith(f"/out/{bucket.name}")
    # The argv is parsed where no Neuron device exists, as on CI runners and CPU build nodes:
    # there upstream requires --instance_type (optimum/commands/export/neuronx.py:48-56).
    assert "required: --instance_type" in parsed[len(CASES)]["error"]


def test_architectures_mirror_upstreams_decoder_registry(upstream):
    assert upstream["decoders"] == sorted(NEURON_DECODERS)
    assert upstream["mistral"] is False  # hence Mistral goes as Llama, or not at all


def test_the_standin_runtime_has_the_real_signatures(upstream):
    import inspect

    cls = standin_module().NeuronModelForCausalLM

    def describe(fn) -> list:
        return [
            [p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(fn).parameters.values()
        ]

    real = upstream["signatures"]
    assert describe(cls.from_pretrained) == real["from_pretrained"]
    assert describe(cls.generate) == real["generate"]
    assert real["generate_owner"] == "NxDGenerationMixin"
    assert describe(cls.forward) == real["forward"]
    assert real["forward_owner"] == "NxDModelForCausalLM"


def test_the_standin_neuron_config_reads_as_upstreams(upstream):
    module = standin_module()
    for fields, real in zip((BATCH4, BATCH1, LOGITS), upstream["config_fields"], strict=True):
        mine = module.NxDNeuronConfig({**fields, **META})
        assert {k: getattr(mine, k) for k in real} == real
    # Continuous batching: prefill one row a graph call, decode the whole batch.
    assert (upstream["config_fields"][0]["ctx_batch_size"], BATCH4["batch_size"]) == (1, 4)


def test_the_engines_sampling_params_pass_upstreams_validation(upstream):
    assert upstream["sampling"]["error"] is None  # upstream's validate_sampling_params
    # greedy is upstream's own default row (prepare_sampling_params)
    assert upstream["sampling"]["default"][0] == list(GREEDY) == list(SAMPLING_ROWS[0])
    # the rows as upstream's vLLM runner builds them (vllm/runner.py:253-263): top_k 0 (all)
    # and top_k above max_topk both become max_topk on the device
    assert [r[0] for r in SAMPLING_ROWS] == [1.0, 256.0, 40.0, 256.0, 1.0]


@pytest.mark.parametrize("name", list(ENGINE))
def test_the_slot_engines_calls_through_upstreams_forward_attend_what_the_standin_saw(
    engine, upstream, name
):
    """Upstream's forward and graph wrappers, given the engine's calls, make every row attend
    exactly the tokens (and positions) the stand-in's row attended, each position computed for
    the sequence it continues: the stand-in's tokens (NEXT_TOKEN of those) are upstream's."""
    fields = ENGINE[name][0]
    replayed = upstream["replay"][list(ENGINE).index(name)]
    for (_, _, route, inputs, attended, _), got in zip(engine[name], replayed, strict=True):
        assert got["route"] == route, inputs
        assert [r["consistent"] for r in got["rows"]] == [True] * len(attended), (inputs, got)
        assert [r["attended"] for r in got["rows"]] == [[list(p) for p in a] for a in attended]
        for graph in got["graph"]:
            if graph["tag"] == "token_generation_model":  # always every cache line, in order
                assert graph["seq_ids"] == list(range(fields["batch_size"]))
            else:  # one prompt a graph call
                assert len(graph["seq_ids"]) == 1
    assert {c[2] for c in engine[name]} == {"context_encoding", "token_generation"}


@pytest.mark.parametrize("name", list(NAIVE))
def test_upstream_overwrites_a_slot_left_out_of_a_decode_and_the_standin_refuses_it(upstream, name):
    """Why the engine feeds every active slot on each decode: upstream pads a partial decode
    batch with copies of its first row into the other cache lines (decoder_wrappers.py:53-88),
    so slot 0 then attends a position computed for another sequence."""
    calls = NAIVE[name]
    *before, last = upstream["replay"][len(ENGINE) + list(NAIVE).index(name)]
    assert all(r["consistent"] for c in before for r in c["rows"])
    assert [r["consistent"] for r in last["rows"]] == [False]
    model = standin_module().NeuronModelForCausalLM("naive", BATCH4, {"vocab_size": 512})
    for c in calls[:-1]:
        model.forward(**as_tensors(c))
    with pytest.raises(ValueError, match=r"does not continue its sequence.*copy of another row"):
        model.forward(**as_tensors(calls[-1]))


def test_the_handed_checkpoint_exports_in_the_release_dtype_with_a_registered_class(upstream):
    mistral, llama = upstream["neuron_config"]
    assert "error" not in mistral and "error" not in llama, (mistral, llama)
    # Mistral (sliding_window null) handed over as Llama: upstream picks its Llama class and
    # takes the dtype from config.json (modeling_utils.py:141), the release's bf16.
    assert mistral["class"].startswith("Llama")
    assert mistral["torch_dtype"] == "bfloat16"
    assert (mistral["batch_size"], mistral["sequence_length"], mistral["tp_degree"]) == (4, 256, 2)
    assert mistral["target"] == "trn1"  # inf2 compiles for trn1 (utils/instance.py:25-47)
    assert llama["torch_dtype"] == "float16"
    assert (llama["batch_size"], llama["sequence_length"], llama["tp_degree"]) == (1, 128, 8)
