"""The runtime: nearest-bucket selection (pure), and generate() on the compiled demo release,
published, pulled and loaded, equal to Hugging Face's greedy generate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.contracts.bucket import Bucket, select_bucket
from pipeline.contracts.graph_abi import ABI_VERSION
from pipeline.errors import InputError, IntegrityError, RuntimeMismatchError

GRID = [Bucket(b, s) for b in (1, 4, 8) for s in (128, 512, 2048)]


@pytest.mark.parametrize(
    ("batch", "seq", "expected"),
    [
        (1, 1, Bucket(1, 128)),
        (1, 128, Bucket(1, 128)),
        (1, 129, Bucket(1, 512)),
        (2, 100, Bucket(4, 128)),
        (4, 600, Bucket(4, 2048)),
        (8, 2048, Bucket(8, 2048)),
        (9, 10, None),
        (1, 2049, None),
    ],
)
def test_select_bucket_fewest_padded_tokens(batch, seq, expected):
    assert select_bucket(GRID, batch, seq) == expected


def test_select_prefers_fewer_padded_tokens_over_smaller_batch():
    # 2 × 300: b4_s512 computes 2048 tokens, b2_s1024 would compute 2048 too → smaller seq wins
    grid = [Bucket(4, 512), Bucket(2, 1024), Bucket(8, 320)]
    assert select_bucket(grid, 2, 300) == Bucket(4, 512)
    assert select_bucket(grid, 3, 310) == Bucket(4, 512)
    assert select_bucket(grid, 5, 310) == Bucket(8, 320)


def _hf_greedy(checkpoint: Path, prompt: list[int], new: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_generate_matches_hugging_face_greedy(installed):
    from pipeline.runtime import BucketedModel

    release, model_dir = installed
    model = BucketedModel.load(model_dir)
    prompts = [[1, 17, 42, 99, 5, 7, 300, 12], [3, 4], list(range(10, 40))]
    got = model.generate(prompts, max_new_tokens=12, eos_token_id=None)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == _hf_greedy(release.checkpoint, prompt, 12)
    # three prompts exceed the largest batch (2): split into two runs, same answers
    assert got == model.generate(prompts[:2], 12, eos_token_id=None) + model.generate(
        prompts[2:], 12, eos_token_id=None
    )


def test_select_and_generate_move_to_larger_buckets_or_fail_clearly(installed):
    from pipeline.runtime import BucketedModel

    _, model_dir = installed
    model = BucketedModel.load(model_dir)
    assert model.select(1, 20).name == "b1_s32"
    assert model.select(2, 33).name == "b2_s64"
    # 30-token prompt + 10 new tokens needs 39 cache slots: moves from s32 to s64
    assert len(model.generate([list(range(1, 31))], 10, eos_token_id=None)[0]) == 10
    with pytest.raises(InputError, match="longer than the largest bucket"):
        model.generate([list(range(1, 61))], 10)
    with pytest.raises(InputError, match="outside the vocabulary"):
        model.generate([[1, 10**6]], 2)
    with pytest.raises(InputError, match="is empty"):
        model.generate([[]], 2)


def test_lazy_load_and_warmup(installed, caplog):
    from pipeline.runtime import BucketedModel

    _, model_dir = installed
    model = BucketedModel.load(model_dir)
    assert not model.runner._graphs
    model.generate([[1, 2, 3]], 2)
    assert list(model.runner._graphs) == [Bucket(1, 32)]
    with caplog.at_level("INFO", logger="inf2_pipeline.runtime"):
        model.warmup()
    # one shared weight copy
    assert len(model.runner._graphs) == 4 and len(model.runner._weights) == 1
    # each bucket's start-up by part (cpu: no CUDA graphs), the one loaded earlier included
    lines = [r.getMessage() for r in caplog.records if r.name == "inf2_pipeline.runtime"]
    assert [line.split(":")[0] for line in lines] == [b.name for b in sorted(model.buckets)]
    # (the parts are of the bucket's own load, whenever it was: weights read by the first;
    # the bucket that generate loaded says so, not a total of ~0 s beside its parts)
    part = (
        r"\S+: packages and weights ([\d.]+ s|loaded earlier) \(weights [\d.]+ s, \d+ "
        r"packages [\d.]+ s, slowest \S+\.pt2 [\d.]+ s\), caches [\d.]+ s"
    )
    assert all(re.fullmatch(part, line) for line in lines), lines
    earlier = [line.split(":")[0] for line in lines if "loaded earlier" in line]
    assert earlier == [Bucket(1, 32).name]


def test_load_refuses_what_it_cannot_run(installed, tmp_path):
    import shutil

    from pipeline.runtime import BucketedModel

    _, model_dir = installed
    copy = tmp_path / "r"
    shutil.copytree(model_dir / "current", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for change, match in [
        ({"backend": "neuron"}, "neuron"),
        ({"versions": {**manifest["versions"], "torch": "1.13.1"}}, "compiled with torch 1.13.1"),
    ]:
        (copy / "manifest.json").write_text(json.dumps({**manifest, **change}))
        with pytest.raises(RuntimeMismatchError, match=match):
            BucketedModel.load(copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeMismatchError, match="not 'cuda'"):
        BucketedModel.load(copy, backend="cuda")
    graph = sorted(copy.glob("buckets/*/graph.json"))[0]
    text = graph.read_text()
    old = f'"abi": {ABI_VERSION - 1}'
    assert f'"abi": {ABI_VERSION}' in text
    graph.write_text(text.replace(f'"abi": {ABI_VERSION}', old))  # same size: passes the size check
    want = f"ABI {ABI_VERSION - 1}; this inf2-pipeline runs ABI {ABI_VERSION}"
    with pytest.raises(RuntimeMismatchError, match=want):
        BucketedModel.load(copy)
    graph.write_text(text)
    next(copy.glob("buckets/*/decode.pt2")).write_bytes(b"truncated")
    with pytest.raises(IntegrityError, match="wrong size"):
        BucketedModel.load(copy)
    with pytest.raises(InputError, match="no release here"):
        BucketedModel.load(tmp_path)


def test_run_command(installed):
    from pipeline.cli import app

    _, model_dir = installed
    r = CliRunner().invoke(
        app, ["run", str(model_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["bucket"] == "b1_s32" and len(data["new_tokens"]) <= 4
    r = CliRunner().invoke(app, ["run", str(model_dir), "--prompt-ids", "1,x"])
    assert r.exit_code == 2 and "not a list of integers" in r.stderr


@pytest.mark.parametrize(
    "damaged", ["config.json", "buckets/b1_s32/graph.json", "buckets/b1_s32/weights.safetensors"]
)
def test_run_of_right_size_wrong_bytes_is_one_line_naming_the_file(installed, tmp_path, damaged):
    """Load checks sizes only; bytes that do not parse are hashed, and the damaged file is
    named (exit 1, pull again), not a JSONDecodeError or SafetensorError traceback."""
    import shutil

    from pipeline.cli import app

    _, model_dir = installed
    copy = tmp_path / "r"
    shutil.copytree(model_dir / "current", copy)
    path = copy / damaged
    data = bytearray(path.read_bytes())
    data[:8] = b"\xff" * 8  # the JSON's first brace, the safetensors header's length
    path.write_bytes(bytes(data))
    r = CliRunner().invoke(app, ["run", str(copy), "--prompt-ids", "1,2,3"])
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], repr(r.exception)
    assert damaged.split("/")[-1] in r.stderr and "pull the release again" in r.stderr


def test_a_callers_mistake_is_not_taken_for_damage(installed, monkeypatch):
    """Only a parser's error hashes the release: a wrong keyword (TypeError) or running out
    of memory is raised as it is, without reading every file first."""
    from pipeline.install import installed as install
    from pipeline.runtime import BucketedModel

    _, model_dir = installed
    hashed = []
    real = install.verify_files

    def spy(inst, mode="sha256", buckets=None):
        hashed.append(mode == "sha256")
        return real(inst, mode, buckets)

    monkeypatch.setattr(install, "verify_files", spy)
    with pytest.raises(TypeError):
        BucketedModel.load(model_dir, hbm_budget=1)
    model = BucketedModel.load(model_dir)
    monkeypatch.setattr(model.runner, "session", lambda b: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(MemoryError):
        model.generate([[1, 2, 3]], 2)
    assert not any(hashed)


def test_run_compare_hf(installed, tiny_checkpoint, tmp_path):
    """--compare-hf: the compiled tokens beside Hugging Face's; another checkpoint is refused
    naming --compare-hf (the flag the user typed), before any model is built."""
    import shutil

    from pipeline.cli import app

    _, model_dir = installed
    args = ["run", str(model_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    r = CliRunner().invoke(app, [*args, "--compare-hf", str(tiny_checkpoint), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["match"] is True and data["hf_tokens"] == data["new_tokens"]
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one weight's last byte: another checkpoint, same shapes
    weights.write_bytes(bytes(data))
    r = CliRunner().invoke(app, [*args, "--compare-hf", str(other)])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: --compare-hf {other}: weights digest ")


def test_weights_that_do_not_fit_the_graphs_are_one_clear_error(installed, tmp_path):
    """Graphs of one build beside the weights of another (say, unfused names): an
    IntegrityError naming the missing weight, not a KeyError from deep in the loader."""
    from safetensors.torch import load_file, save_file

    from pipeline.runtime.graph_loading import BucketGraphs

    _, model_dir = installed
    bucket = next((model_dir / "current" / "buckets").iterdir())
    copy = tmp_path / bucket.name
    for f in bucket.iterdir():
        (copy / f.name).parent.mkdir(exist_ok=True)
        (copy / f.name).write_bytes(f.read_bytes())
    state = load_file(copy / "weights.safetensors")
    del state["model.layers.0.mlp.gate_up_proj.weight"]
    save_file(state, copy / "weights.safetensors")
    with pytest.raises(IntegrityError, match=r"first: model\.layers\.0\.mlp\.gate_up_proj\.weight"):
        BucketGraphs(copy)


def test_a_package_loads_without_probing_the_host(installed, monkeypatch):
    """torch asks for the host's device information at a package load (a probe compiled and
    loaded per CPU vector ISA: most of a process's 36-45 s first load on the H100 host) only
    to warn of a difference from the build; the load skips it, whatever the host's ISAs,
    and torch's own function is back after."""
    from torch._inductor import codecache, cpu_vec_isa

    from pipeline.runtime.graph_loading import BucketGraphs

    real = codecache.get_device_information
    asked = []
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: asked.append("isa"))
    monkeypatch.setattr(
        codecache, "get_device_information", lambda *a: asked.append("info") or real(*a)
    )
    spied = codecache.get_device_information
    _, model_dir = installed
    BucketGraphs(next((model_dir / "current" / "buckets").iterdir()))
    assert asked == []
    assert codecache.get_device_information is spied  # put back as it was


def test_cuda_kernels_for_another_gpu_architecture_are_refused(monkeypatch, tmp_path):
    from pipeline.contracts.graph_abi import GraphSpec
    from pipeline.runtime import graph_loading

    spec = GraphSpec(1, 32, 2, 2, 8, 512, "bfloat16", "cuda", cuda_arch="sm_90")
    monkeypatch.setattr(graph_loading, "cuda_arch", lambda device=None: "sm_89")
    with pytest.raises(RuntimeMismatchError, match="compiled for sm_90 GPUs, this GPU is sm_89"):
        graph_loading.check_runs_here(spec, tmp_path)
    monkeypatch.setattr(graph_loading, "cuda_arch", lambda device=None: "sm_90")
    graph_loading.check_runs_here(spec, tmp_path)  # same architecture: fine


def test_a_process_that_dies_leaves_its_extracted_packages_to_the_next_load(installed, tmp_path):
    """torch's loader extracts each package under TMPDIR and removes it only when destroyed:
    the engine's process ends by os._exit or SIGKILL. Each process extracts into a folder of
    its own, and a later load sweeps the folders of processes that are gone."""
    import os
    import subprocess
    import sys

    from pipeline.runtime import graph_loading

    _, model_dir = installed
    load = (
        "import os, sys; from pipeline.runtime import BucketedModel; "
        "m = BucketedModel.load(sys.argv[1]); m.generate([[1, 2, 3]], 2); "
        "print(os.getpid(), flush=True); os._exit(0)"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}

    def pid_of_a_load() -> str:
        cmd = [sys.executable, "-c", load, str(model_dir)]
        return subprocess.run(
            cmd, env=env, capture_output=True, text=True, check=True
        ).stdout.split()[-1]

    pid = pid_of_a_load()
    (left,) = tmp_path.glob(f"{graph_loading.EXTRACT_PREFIX}*-{pid}")
    assert any(left.iterdir())  # what the dead process had extracted, still there
    assert not list(tmp_path.glob("aotinductor_*"))  # nothing outside its folder
    again = pid_of_a_load()
    assert not left.exists()  # swept by the next process's first load
    assert [p.name.rsplit("-", 1)[1] for p in tmp_path.iterdir()] == [again]
