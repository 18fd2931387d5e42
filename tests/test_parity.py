"""parity: the compiled demo release passes against eager Hugging Face; damaged weights,
perturbed logits and a wrong checkpoint fail; a neuron release without the Neuron runtime
says so. The metric helpers are checked on their own."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.contracts import backend_table
from pipeline.parity import TOLERANCES, BucketParity, prompt_lengths, tolerance_dtype
from pipeline.parity.check import _greedy_verdict
from pipeline.parity.reference import _unpad
from pipeline.parity.targets import AotiTarget
from pipeline.plan.gqa import plan_gqa


def parity(*args: str):
    return CliRunner().invoke(app, ["parity", *map(str, args)])


def copy_release(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir / "current", dest)
    return dest


def test_compiled_demo_passes_and_the_report_is_written(installed, tmp_path):
    _, model_dir = installed
    report = tmp_path / "out" / "parity.md"
    r = parity(model_dir, "--reference", "cpu", "--report", report, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["passed"] and data["tolerance"]["dtype"] == "float32"
    assert [b["bucket"] for b in data["buckets"]] == ["b1_s32", "b1_s64", "b2_s32", "b2_s64"]
    for b in data["buckets"]:
        assert b["max_rel"] <= 1e-4 and b["top1"] == 1.0 and b["greedy_exact"] == 1.0
        assert b["rows"] == b["prompts"] * 9  # prefill + 8 teacher-forced decode steps
        mixed = b["mixed"]  # the demo's buckets of two rows have a mixed graph at 32
        if b["bucket"].startswith("b1_"):
            assert mixed is None
        else:  # one row stepped, one prompt prefilled beside it
            assert mixed["lengths"] == [32] and mixed["rows"] == 2 and mixed["flips"] == 0
            assert mixed["max_rel"] <= 1e-4
    text = report.read_text()
    assert "| b2_s64 | 4 | 1, 32, 56 |" in text and "**PASS**: 4/4" in text
    assert "- b2_s64 at 32: 2 rows" in text
    assert "max relative logit error ≤ 0.0001" in text  # the tolerances are stated
    assert not list(report.parent.glob(".*incomplete"))


def test_checkpoint_reference_must_be_the_compiled_checkpoint(installed, tmp_path):
    from pipeline.tiny_model import write_tiny_model

    release, model_dir = installed
    r = parity(model_dir, "--checkpoint", release.checkpoint, "--bucket", "b1_s32")
    assert r.exit_code == 0, r.output
    assert "PASS: 1/1 buckets" in r.stdout
    other = write_tiny_model(tmp_path / "other", seed=1)
    r = parity(model_dir, "--checkpoint", other, "--bucket", "b1_s32")
    assert r.exit_code == 2
    assert "weights digest" in r.stderr and "compiled from" in r.stderr


def test_damaged_weights_fail_with_exit_1(installed, tmp_path):
    _, model_dir = installed
    copy = copy_release(model_dir, tmp_path / "r")
    weights = copy / "buckets" / "b1_s32" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # same size: only the sha256 tells
    weights.write_bytes(bytes(data))
    r = parity(copy, "--bucket", "b1_s32")
    assert r.exit_code == 1
    assert "weights.safetensors: sha256" in r.stderr and "pull the release again" in r.stderr


def test_wrong_weights_recorded_in_the_manifest_fail_against_the_checkpoint(installed, tmp_path):
    """A release whose weights are consistently wrong (as a bad padding or cast would make
    them): the bytes match the manifest, so only the numbers can tell."""
    from safetensors.torch import load_file, save_file

    from pipeline._files import sha256_file

    release, model_dir = installed
    copy = copy_release(model_dir, tmp_path / "r")
    weights = copy / "buckets" / "b1_s32" / "weights.safetensors"
    state = load_file(str(weights))
    state["model.layers.1.mlp.down_proj.weight"] *= 1.05
    weights.unlink()
    save_file(state, str(weights), metadata={"format": "pt"})
    manifest = json.loads((copy / "manifest.json").read_text())
    for ref in manifest["buckets"]["b1_s32"]["files"]:
        if ref["path"] == "weights.safetensors":
            ref.update(sha256=sha256_file(weights), size=weights.stat().st_size)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    report = tmp_path / "parity.md"
    args = ("--checkpoint", release.checkpoint, "--bucket", "b1_s32", "--report", report)
    r = parity(copy, *args)
    assert r.exit_code == 1, r.output
    assert "b1_s32: " in r.stdout and "FAIL: max relative logit error" in r.stdout
    assert "| b1_s32 |" in report.read_text() and "**FAIL**" in report.read_text()


class PerturbedRunner:
    """The real runner, with a constant added to every decode logit of row 0: the argmax is
    untouched, so only the logit error can catch it."""

    def __init__(self, *args, **kwargs) -> None:
        self.inner = AotiTarget(*args, **kwargs)
        self.device = self.inner.device

    def session(self, bucket):
        session = self.inner.session(bucket)
        decode = session.decode

        class Wrapped:
            batch, seq = session.batch, session.seq
            prefill, generate = session.prefill, session.generate

            def decode(self, tokens, positions):
                out = decode(tokens, positions).clone()
                out[0] += 0.01
                return out

        return Wrapped()


def test_perturbed_logits_fail_on_the_logit_error_alone(installed, monkeypatch):
    _, model_dir = installed
    spec = replace(backend_table.BACKENDS["cpu"], parity=f"{__name__}:PerturbedRunner")
    monkeypatch.setitem(backend_table.BACKENDS, "cpu", spec)
    r = parity(model_dir, "--bucket", "b2_s32", "--json")
    assert r.exit_code == 1, r.output
    (bucket,) = json.loads(r.stdout)["buckets"]
    assert bucket["top1"] == 1.0 and bucket["greedy_exact"] == 1.0
    assert bucket["failures"] == [f"max relative logit error {bucket['max_rel']:.3g} > 0.0001"]


def test_a_wrong_mixed_graph_fails_parity(installed, monkeypatch):
    """A mixed graph whose logits are off (a miscompile the server would only hit when it
    folds a prompt into a step) fails the bucket, though its other graphs pass."""
    from pipeline.runtime.session_slots import SessionSlots

    _, model_dir = installed
    real = SessionSlots.mixed_logits

    def off(self, *args):
        out = real(self, *args)
        out[-1] += 0.01  # the prompt's row
        return out

    monkeypatch.setattr(SessionSlots, "mixed_logits", off)
    r = parity(model_dir, "--bucket", "b2_s32", "--json")
    assert r.exit_code == 1, r.output
    (bucket,) = json.loads(r.stdout)["buckets"]
    assert bucket["max_rel"] <= 1e-4 and bucket["top1"] == 1.0
    mixed = f"mixed calls: max relative logit error {bucket['mixed']['max_rel']:.3g} > 0.0001"
    assert bucket["failures"] == [mixed]


def test_neuron_release_without_the_neuron_runtime_fails_clearly(installed, tmp_path):
    _, model_dir = installed
    copy = copy_release(model_dir, tmp_path / "r")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "backend": "neuron"}))
    r = parity(copy)
    assert r.exit_code == 2
    assert "is a neuron release and optimum.neuron cannot be imported here" in r.stderr
    assert "optimum-neuron[neuronx]" in r.stderr
    assert "Traceback" not in r.output


# --- the pieces ----------------------------------------------------------------------------


def test_prompt_lengths_cover_one_token_half_and_the_longest_that_fits():
    assert prompt_lengths(32, 8) == [1, 16, 24]
    assert prompt_lengths(256, 8) == [1, 128, 248]
    assert prompt_lengths(8, 7) == [1]
    assert prompt_lengths(4, 1) == [1, 2, 3]


def test_half_precision_compares_enough_rows_for_its_top1_share_to_mean_something():
    """A top-1 share below 100% is a rate: a b1 bucket's 3 prompts (27 rows) would fail a
    94.2%-agreeing release one time in five, so half precision checks at least 256 rows."""
    from pipeline.parity.check import make_prompts

    def rows(batch: int, dtype: str) -> int:
        tol = TOLERANCES[dtype]
        batches = list(make_prompts("b", batch, 64, 8, 512, 0, tol.min_rows))
        assert all(len(prompts) == batch for prompts in batches)
        assert {len(p) for prompts in batches for p in prompts} == set(prompt_lengths(64, 8))
        return len(batches) * batch * 9

    assert rows(1, "float32") == 27  # exact agreement: every row must match, 3 prompts do
    assert rows(1, "bfloat16") == 261 and rows(1, "float16") == 261  # 29 prompts
    assert rows(8, "bfloat16") == 288 and rows(32, "bfloat16") == 288  # one batch of 32


def test_tolerance_follows_the_dtype_and_neurons_auto_cast():
    class M:
        def __init__(self, backend, dtype, cast):
            self.backend, self.dtype, self.auto_cast_type = backend, dtype, cast

    assert tolerance_dtype(M("cpu", "float32", "bf16")) == "float32"  # cpu ignores auto-cast
    assert tolerance_dtype(M("neuron", "float32", "bf16")) == "bfloat16"
    assert tolerance_dtype(M("neuron", "bfloat16", "fp32")) == "bfloat16"
    assert TOLERANCES["float32"].max_rel < TOLERANCES["float16"].max_rel
    assert TOLERANCES["float16"].max_rel < TOLERANCES["bfloat16"].max_rel


def test_greedy_divergence_is_forgiven_only_at_a_near_tie():
    tol = TOLERANCES["float32"]
    logits = torch.zeros(3, 5)
    logits[:, 2] = 10.0  # the reference picks token 2 at every step
    logits[1, 4] = 10.0 - 1e-4  # ... and at step 1 token 4 is within 2 × 1e-4 × 10
    ref = ([2, 2, 2], logits)
    assert _greedy_verdict([2, 2, 2], ref, tol) == "exact"
    assert _greedy_verdict([2, 4, 0], ref, tol) == "near-tie"  # later tokens may differ
    assert _greedy_verdict([2, 2, 3], ref, tol) == "decisive"
    assert _greedy_verdict([2, 2], ref, tol) == "decisive"


def test_nan_logits_fail():
    from pipeline.parity.check import _failures

    b = BucketParity("b1_s32", [1], prompts=1, rows=1, max_rel=float("nan"), top1=1.0)
    assert _failures(b, TOLERANCES["float32"]) == ["max relative logit error nan > 0.0001"]


@pytest.mark.parametrize(("q", "kv", "tp"), [(8, 2, 4), (6, 2, 4), (4, 4, 8), (8, 2, 3)])
def test_unpad_inverts_the_gqa_padding(q, kv, tp):
    from pipeline.compile.gqa_pad import pad_tensor
    from pipeline.plan.checkpoint import ModelShape

    d, hidden = 4, 16
    plan = plan_gqa(q, kv, tp)
    shape = ModelShape(
        model_type="llama",
        hidden=hidden,
        q_heads=q,
        kv_heads=kv,
        head_dim=d,
        layers=1,
        intermediate=32,
        vocab=10,
        tied_embeddings=False,
        qkv_bias=False,
    )
    g = torch.Generator().manual_seed(0)
    for name, rows, cols in [
        ("q_proj.weight", q * d, hidden),
        ("k_proj.weight", kv * d, hidden),
        ("v_proj.bias", kv * d, None),
        ("o_proj.weight", hidden, q * d),
    ]:
        full = f"model.layers.0.self_attn.{name}"
        size = (rows, cols) if cols else (rows,)
        original = torch.randn(size, generator=g)
        padded = pad_tensor(full, original, shape, plan)
        assert torch.equal(_unpad(full, padded, d, plan), original)


# --- on an NVIDIA GPU -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_release_passes_against_the_cuda_reference(compiled_cuda_release, tmp_path):
    report = tmp_path / "parity-cuda.md"
    r = parity(compiled_cuda_release, "--reference", "cuda", "--report", report, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["passed"] and data["cuda_graphs"] and data["reference"]["device"] == "cuda"
    assert len(data["buckets"]) == 4
    print(report.read_text())  # the numbers, for the record (pytest -s)


def test_a_top1_flip_is_excused_only_at_a_reference_near_tie():
    from pipeline.parity.check import Tolerance, _near_tie

    tol = Tolerance(max_rel=0.05, min_top1=0.9)
    row = torch.tensor([10.0, 9.5, 2.0])  # 2 × 0.05 × 10 = 1.0 of slack
    assert _near_tie(row, 0, 0, tol) == "exact"
    assert _near_tie(row, 0, 1, tol) == "near-tie"  # 0.5 apart: within the tolerance
    assert _near_tie(row, 0, 2, tol) == "decisive"  # 8 apart: a real error


def test_top1_is_gated_on_exact_agreement_and_counts_near_ties():
    """A flip at a near-tie still counts against top-1: excusing it would make the gate
    redundant (any flip under the logit tolerance is a near-tie by that bound)."""
    from pipeline.parity.check import _failures

    b = BucketParity("b1_s2048", [1], prompts=3, rows=27, max_rel=0.02, top1=24 / 27)
    b.top1_near_ties = 3
    (failure,) = _failures(b, TOLERANCES["bfloat16"])
    assert failure == "top-1 agreement 88.9% < 90% (3 of 3 differing rows at a reference near-tie)"
