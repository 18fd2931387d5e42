"""Which architectures the neuron backend exports: optimum-neuron 0.4.5's registered decoders
(the list is checked against the real registry in tests/test_neuron_upstream.py), and Mistral
without a sliding window as Llama (same computation: proved here with transformers on cpu).
Anything else is refused by validate/plan/compile in one line, for neuron only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.compile.backends.neuron import write_export_checkpoint
from pipeline.plan.checkpoint import neuron_export_config
from tests.config_factory import release_yaml

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> Path:
    """A tiny Mistral with sliding_window null (like Mistral-7B v0.2/v0.3)."""
    from pipeline.tiny_model import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("mistral") / "m", arch="mistral")
    edit(path, sliding_window=None)
    return path


def edit(ckpt: Path, **changes) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **changes}))


def mistral_config(write_config, ckpt: Path, backend: str) -> Path:
    text = release_yaml(checkpoint=ckpt, backend=backend, batch_sizes=[1], sequence_lengths=[64])
    return write_config(text)


def variant(src: Path, dest: Path, **changes) -> Path:
    """A copy of ``src`` (weights linked) with config.json changed."""
    dest.mkdir()
    for f in src.iterdir():
        (dest / f.name).hardlink_to(f)
    (dest / "config.json").unlink()
    (dest / "config.json").write_text((src / "config.json").read_text())
    edit(dest, **changes)
    return dest


def test_mistral_without_sliding_window_exported_as_llama_gives_equal_logits(
    tiny_mistral, tmp_path
):
    import torch
    from transformers import AutoModelForCausalLM

    handed = write_export_checkpoint(tiny_mistral, tmp_path / "handed", "float32")
    cfg = json.loads((handed / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert "sliding_window" not in cfg and cfg["dtype"] == "float32"
    mistral = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32).eval()
    llama = AutoModelForCausalLM.from_pretrained(handed, dtype=torch.float32).eval()
    assert type(mistral).__name__ == "MistralForCausalLM"
    assert type(llama).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(3, 512, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = mistral(tokens).logits, llama(tokens).logits
    assert (a - b).abs().max().item() == 0.0


def test_the_shipped_mistral_config_exports_as_llama():
    cfg = json.loads((REPO / "models" / "mistral-7b-v0.3" / "config.json").read_text())
    assert neuron_export_config(cfg, "mistral-7b-v0.3")["model_type"] == "llama"
    r = CliRunner().invoke(app, ["validate", str(REPO / "configs/mistral-7b-inf2.24xlarge.yaml")])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"sliding_window": 4096}, "has a sliding window (4096 tokens)"),
        ({"head_dim": 16}, "has head_dim 16 ≠ hidden_size/heads (8)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "uses rope type 'yarn'"),
        (
            {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
            "architecture GemmaForCausalLM (model_type 'gemma') cannot be exported for neuron",
        ),
    ],
)
def test_validate_and_plan_refuse_what_neuron_cannot_export_in_one_line(
    tiny_mistral, tmp_path, write_config, changes, why
):
    ckpt = variant(tiny_mistral, tmp_path / "ckpt", **changes)
    config = mistral_config(write_config, ckpt, "neuron")
    for command in ("validate", "plan"):
        r = CliRunner().invoke(app, [command, str(config)])
        assert r.exit_code == 2, r.output
        (line,) = r.stderr.strip().splitlines()
        assert why in line
        assert "optimum-neuron 0.4.5 exports: granite, llama, llama4_text, mixtral" in line
        assert "mistral without a sliding window, as llama" in line


def test_other_backends_are_not_refused(tiny_mistral, tmp_path, write_config):
    ckpt = variant(tiny_mistral, tmp_path / "ckpt", sliding_window=4096)
    config = mistral_config(write_config, ckpt, "cpu")
    assert CliRunner().invoke(app, ["validate", str(config)]).exit_code == 0


def test_compile_backend_neuron_refuses_in_one_line(
    tiny_mistral, tmp_path, write_config, monkeypatch
):
    from pipeline.compile import backends
    from tests.neuron_fakes import install_fake_sdk

    install_fake_sdk(tmp_path, monkeypatch)
    backends._instances.clear()
    ckpt = variant(tiny_mistral, tmp_path / "ckpt", sliding_window=4096)
    config = mistral_config(write_config, ckpt, "cpu")
    r = CliRunner().invoke(app, ["compile", str(config), "--backend", "neuron"])
    backends._instances.clear()
    assert r.exit_code == 2, r.output
    (line,) = r.stderr.strip().splitlines()
    assert "has a sliding window (4096 tokens), so it cannot be exported as llama" in line


def test_plan_sizes_the_release_dtype_and_every_bucket_resident(tmp_path, write_config):
    from pipeline.plan.config import load_config
    from pipeline.plan.report import plan_release

    bf16 = plan_release(load_config(REPO / "configs/qwen2.5-7b-inf2.8xlarge.yaml"))
    data = (REPO / "configs/qwen2.5-7b-inf2.8xlarge.yaml").read_text()
    fp32 = tmp_path / "configs" / "fp32.yaml"
    fp32.parent.mkdir()
    fp32.write_text(data.replace("dtype: bfloat16", "dtype: float32"))
    (tmp_path / "models").symlink_to(REPO / "models")
    wide = plan_release(load_config(fp32))
    # The dtype the exporter is handed is the one plan sizes: 2 bytes against 4.
    assert wide.weight_bytes_per_core == 2 * bf16.weight_bytes_per_core
    r = bf16.resident
    each = [bf16.weight_bytes_per_core + m.kv_cache_bytes for m in bf16.buckets]
    assert r.weights_per_bucket and r.total_bytes == sum(each) and not r.fits
    assert r.max_loaded == 2  # ~7.1 GiB of weights per core per bucket, 16 GiB per core
    out = CliRunner().invoke(app, ["plan", str(REPO / "configs/qwen2.5-7b-inf2.8xlarge.yaml")])
    assert out.exit_code == 0
    text = " ".join(out.stdout.split())
    assert "all 6 buckets resident together (a weights copy each): 43.13 GiB" in text
    assert "keeps at most 2 of 6 loaded at once" in text
