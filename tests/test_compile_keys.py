"""Cache keys change with everything that changes the output, and with nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.compile import keys
from pipeline.compile.keys import bucket_cache_key
from pipeline.contracts import digests
from pipeline.contracts.bucket import Bucket
from pipeline.contracts.digests import weights_digest
from pipeline.plan.config import load_config
from tests.config_factory import release_yaml

REPO = Path(__file__).resolve().parent.parent
CONFIG = release_yaml(
    instance_type="inf2.24xlarge",
    flags=["--model-type=transformer"],
    auto_cast_type="fp32",
    timeout_s=900,
)
B = Bucket(1, 32)
VERSIONS = {"torch": "2.13.0+cpu", "transformers": "5.0"}


@pytest.fixture
def ckpt_copy(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny checkpoint, safe to modify."""
    import shutil

    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


def key_of(write_config, text: str, ckpt: Path | None = None, **kw) -> str:
    if ckpt is not None:
        text = text.replace("{ckpt}", str(ckpt))
    release = load_config(write_config(text))
    kw.setdefault("versions", VERSIONS)
    return bucket_cache_key(release, kw.pop("bucket", B), kw.pop("backend", "cpu"), **kw)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("dtype: float32", "dtype: bfloat16"),
        ("tp_degree: 2", "tp_degree: 4"),
        ('flags: ["--model-type=transformer"]', 'flags: ["--model-type=transformer", "-O1"]'),
        ('flags: ["--model-type=transformer"]', 'flags: ["inductor.max_autotune=true"]'),
        ("auto_cast_type: fp32", "auto_cast_type: bf16"),
    ],
)
def test_key_changes_with_each_input_that_changes_the_output(write_config, old, new):
    assert key_of(write_config, CONFIG) != key_of(write_config, CONFIG.replace(old, new))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("timeout_s: 900", "timeout_s: 60"),
        ("store: store", "store: elsewhere"),
        ("name: tiny", "name: tiny-renamed"),
        ("sequence_lengths: [32]", "sequence_lengths: [32, 64]"),  # other buckets only
        ("instance_type: inf2.24xlarge", "instance_type: inf2.48xlarge"),
        # 2 KV heads split evenly over tp 2: no padding whichever strategy is asked for
        ("tp_degree: 2", "tp_degree: 2\n  gqa_strategy: convert_to_mha"),
    ],
)
def test_key_ignores_what_does_not_change_the_output(write_config, old, new):
    assert key_of(write_config, CONFIG) == key_of(write_config, CONFIG.replace(old, new))


def test_key_changes_with_the_gqa_strategy_where_heads_are_padded(write_config):
    tp4 = CONFIG.replace("tp_degree: 2", "tp_degree: 4")
    mha = tp4.replace("tp_degree: 4", "tp_degree: 4\n  gqa_strategy: convert_to_mha")
    assert key_of(write_config, tp4) != key_of(write_config, mha)


def test_key_changes_with_bucket_backend_and_versions(write_config):
    base = key_of(write_config, CONFIG)
    assert key_of(write_config, CONFIG, bucket=Bucket(2, 32)) != base
    assert key_of(write_config, CONFIG, backend="cuda") != base
    assert key_of(write_config, CONFIG, versions={**VERSIONS, "torch": "2.14.0"}) != base


def test_graph_key_changes_with_the_model_config_but_not_the_weights(write_config, ckpt_copy):
    """The graphs are exported on uninitialised tensors: other weights, same graphs. The
    weights key (tests/test_finetune.py) is what changes with them."""
    text = CONFIG.replace("{ckpt}", str(ckpt_copy))
    base = key_of(write_config, text)
    cfg = ckpt_copy / "config.json"
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps(data, indent=4, sort_keys=True))  # formatting only
    assert key_of(write_config, text) == base
    cfg.write_text(json.dumps({**data, "rms_norm_eps": 1e-5}))
    assert key_of(write_config, text) != base
    cfg.write_text(json.dumps(data))
    weights = ckpt_copy / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    digests._memo.clear()
    assert key_of(write_config, text) == base


def test_weights_digest_is_hashed_once_and_remembered(ckpt_copy, tmp_path, monkeypatch):
    calls = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: calls.append(p) or real(p))
    stat_cache = tmp_path / "digests.json"
    first = weights_digest(ckpt_copy, stat_cache=stat_cache)
    assert weights_digest(ckpt_copy, stat_cache=stat_cache) == first
    assert len(calls) == 1  # memoised in this process
    digests._memo.clear()
    assert weights_digest(ckpt_copy, stat_cache=stat_cache) == first
    assert len(calls) == 1  # remembered by (path, size, mtime, inode)
    digests._memo.clear()
    assert weights_digest(ckpt_copy) == first
    assert len(calls) == 2  # no stat cache: hashed again


def test_missing_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception, match="no weight files"):
        weights_digest(tmp_path)


def test_keys_import_and_compute_without_torch(write_config):
    config = write_config(CONFIG)
    code = (
        "import sys; from pipeline.plan.config import load_config; "
        "from pipeline.compile.keys import bucket_cache_key; "
        "from pipeline.plan.buckets import Bucket; "
        f"k = bucket_cache_key(load_config({str(config)!r}), Bucket(1, 32), 'cpu'); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(k)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) == 64


def test_key_changes_with_the_cxx_compiler(write_config, monkeypatch, tmp_path):
    """Inductor builds packages with $CXX: another compiler is another package (a CUDA image
    we used had a CXX wrapper whose packages crashed on load)."""
    from pipeline.compile.backends import aoti

    base = key_of(write_config, CONFIG)
    wrapper = tmp_path / "g++-wrapper"
    wrapper.write_text("#!/bin/sh\necho 'g++-wrapper 1.0'\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    aoti.cxx_identity.cache_clear()
    try:
        assert aoti.cxx_identity() == f"{wrapper}: g++-wrapper 1.0"
        assert key_of(write_config, CONFIG) != base
    finally:
        monkeypatch.undo()
        aoti.cxx_identity.cache_clear()
    assert key_of(write_config, CONFIG) == base


def test_cuda_keys_change_with_the_gpu_architecture(write_config, monkeypatch):
    from pipeline.compile.backends import aoti

    monkeypatch.setattr(aoti, "gpu_compute_capability", lambda: "9.0")
    h200 = key_of(write_config, CONFIG, backend="cuda")
    monkeypatch.setattr(aoti, "gpu_compute_capability", lambda: "8.9")
    assert key_of(write_config, CONFIG, backend="cuda") != h200


def test_check_loads_raises_on_a_package_that_does_not_load(tmp_path):
    pytest.importorskip("torch")
    from pipeline.compile.backends.aoti import check_loads

    bad = tmp_path / "decode.pt2"
    bad.write_bytes(b"not a package")
    with pytest.raises(Exception):  # noqa: B017 - torch's loader raises several kinds
        check_loads(bad)


def test_a_buckets_prefill_lengths_are_in_its_graph_key_on_cpu_only(write_config):
    """A prefill length below a bucket's sequence adds a graph to it (cpu/cuda), one above
    does not; neuron buckets ignore prefill lengths (optimum-neuron pads every prefill to
    the export's length), so their keys do not move."""
    grid = "sequence_lengths: [32]"
    short = CONFIG.replace(grid, f"{grid}\n  prefill_lengths: [8]")
    longer = CONFIG.replace(grid, f"{grid}\n  prefill_lengths: [64]")
    assert key_of(write_config, short) != key_of(write_config, CONFIG)
    assert key_of(write_config, longer) == key_of(write_config, CONFIG)
    assert load_config(write_config(short)).grid.prefill_lengths == [8]

    def neuron(text: str) -> dict:
        release = load_config(write_config(text))
        return keys.key_material(release, B, "neuron", weights="w", versions=VERSIONS)

    assert "prefill_lengths" not in neuron(short)
    assert "prefill_lengths" in keys.key_material(
        load_config(write_config(short)), B, "cpu", versions=VERSIONS
    )
