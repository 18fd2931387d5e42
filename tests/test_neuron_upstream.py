"""The Neuron path against optimum-neuron 0.4.5's own code, run in the side environment
(tests/neuron_upstream.py; ``make test`` builds it): the export argv through upstream's real
parser, the architecture list against its real decoder registry, the stand-in runtime's
signatures against the real classes, and the checkpoint the backend hands the exporter
through upstream's get_neuron_config. One probe process answers all of them (module fixture).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.compile.backends.base import BucketJob
from pipeline.compile.backends.neuron import export_command, write_export_checkpoint
from pipeline.plan.buckets import Bucket
from pipeline.plan.checkpoint import NEURON_DECODERS
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


@pytest.fixture(scope="module")
def upstream(handed, tmp_path_factory) -> dict:
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
    import importlib.util

    path = Path(__file__).parent / "neuron_standin" / "optimum" / "neuron" / "__init__.py"
    spec = importlib.util.spec_from_file_location("standin_optimum_neuron", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = module.NeuronModelForCausalLM

    import inspect

    def describe(fn) -> list:
        return [
            [p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(fn).parameters.values()
        ]

    real = upstream["signatures"]
    assert describe(cls.from_pretrained) == real["from_pretrained"]
    assert describe(cls.generate) == real["generate"]
    assert real["generate_owner"] == "NxDGenerationMixin"


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
