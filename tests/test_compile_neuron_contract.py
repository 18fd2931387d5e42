"""The neuron backend against the documented CLI contract, with stand-in executables.

No Neuron SDK runs here: ``optimum-cli`` and ``neuronx-cc`` are small scripts these tests put
on PATH (tests/neuron_fakes.py). They record how they were called and behave as told by
FAKE_NEURON_MODE. What they check is our side of the contract: arguments, environment, the
checkpoint handed over, exit codes, output files, timeout, logs. The argument names
themselves are checked against upstream's real parser in tests/test_neuron_upstream.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.compile import backends
from pipeline.compile.backends import resolve_backend
from pipeline.compile.scheduler import compile_release
from pipeline.plan.config import load_config
from pipeline.store import open_store
from pipeline.store.cache import read_cache_entry
from tests.config_factory import release_yaml
from tests.neuron_fakes import CC_VERSION, VERSIONS, install_fake_sdk

pytestmark = pytest.mark.contract


def config_yaml(dtype: str) -> str:
    return release_yaml(
        dtype=dtype,
        backend="neuron",
        instance_type="inf2.24xlarge",
        tp_degree=4,
        batch_sizes=[2],
        sequence_lengths=[64],
        flags=["--model-type=transformer", "-O1", "inductor.max_autotune=true"],
        auto_cast_type="bf16",
        timeout_s=60,
    )


@pytest.fixture(autouse=True)
def fresh_backends(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default workdir (work/compile/<model>) lands here
    backends._instances.clear()  # the compiler version is remembered per instance
    yield
    backends._instances.clear()


@pytest.fixture
def sdk(tmp_path, monkeypatch) -> Path:
    """Stand-ins for the Neuron SDK (tests/neuron_fakes.py); returns the exporter's record."""
    return install_fake_sdk(tmp_path, monkeypatch)


@pytest.fixture
def config(write_config) -> Path:
    # float32 like the tiny checkpoint: nothing to cast, so prepare needs no torch (fast)
    return write_config(config_yaml("float32"))


@pytest.fixture
def config_bf16(write_config) -> Path:
    return write_config(config_yaml("bfloat16"))


def compile_(config: Path, **kw):
    (result,) = compile_release(load_config(config), workdir=config.parent / "work", **kw).results
    return result


def test_neuron_contract_arguments_environment_and_outputs(
    sdk, config_bf16, tiny_checkpoint, monkeypatch
):
    config = config_bf16
    monkeypatch.setenv("NEURON_CC_FLAGS", "--cache_dir=/var/cache/neuron")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "s3://bucket/neuron-cache")
    result = compile_(config)
    assert result.status == "compiled", result.error
    call = json.loads(sdk.read_text())
    model = Path(call["argv"][call["argv"].index("--model") + 1])
    assert call["argv"][:-1] == [
        "export",
        "neuron",
        "--model",
        str(model),
        "--task",
        "text-generation",
        "--batch_size",
        "2",
        "--sequence_length",
        "64",
        "--tensor_parallel_size",
        "4",
        "--instance_type",
        "inf2",
    ]
    # The user's flags first, the config's appended (inductor.* left out); the cache URL
    # reaches the exporter untouched.
    assert call["NEURON_CC_FLAGS"] == "--cache_dir=/var/cache/neuron --model-type=transformer -O1"
    assert call["NEURON_COMPILE_CACHE_URL"] == "s3://bucket/neuron-cache"
    # The checkpoint handed over: config.json in the release dtype, weights cast (the tiny
    # checkpoint is fp32), the rest hard-linked.
    handed = json.loads((model / "config.json").read_text())
    assert handed["dtype"] == handed["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}  # noqa: SIM118
    gen = model / "generation_config.json"
    assert gen.stat().st_ino == (tiny_checkpoint / "generation_config.json").stat().st_ino
    store = open_store(str(config.parent / "store"))
    entry = read_cache_entry(store, result.key)
    assert {f.path for f in entry.files} == {
        "model.pt",
        "neuron_config.json",
        "config.json",
        *(f"checkpoint/weights/tp{r}_sharded_checkpoint.safetensors" for r in range(4)),
        # the exporter saves the checkpoint's tokenizer beside the model, as upstream does
        *(n for n in ("tokenizer.json", "tokenizer_config.json") if (model / n).is_file()),
    }
    assert entry.meta["log"]["path"] == "compile.log" and entry.meta["log"]["size"] > 0
    want = {"neuronx-cc": CC_VERSION, **VERSIONS}
    assert entry.meta["versions"] == want
    assert entry.meta["key_material"]["versions"] == want
    assert entry.meta["key_material"]["options"]["instance_family"] == "inf2"
    log = result.log.read_text()
    assert "Compiler status PASS" in log and "NEURON_CC_FLAGS=" in log
    assert "NEURON_COMPILE_CACHE_URL=s3://bucket/neuron-cache" in log


def test_neuron_contract_argv_has_no_flags_decoders_ignore(tmp_path):
    from pipeline.compile.backends.base import BucketJob
    from pipeline.compile.backends.neuron import export_command
    from pipeline.contracts.bucket import Bucket

    job = BucketJob(
        tmp_path, Bucket(1, 128), 2, {}, "float32", (), "fp32", tmp_path / "out",
        instance_type="trn1.32xlarge",
    )  # fmt: skip
    argv = export_command(job, tmp_path / "ckpt", tmp_path / "out")
    assert not {"--auto_cast", "--auto_cast_type", "--torch_dtype", "--num_cores"} & set(argv)
    assert argv[argv.index("--instance_type") + 1] == "trn1"
    assert argv[-1] == str(tmp_path / "out")


def test_neuron_contract_user_cache_flags_stay_out_of_the_key(sdk, config, monkeypatch):
    first = compile_(config)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--cache_dir=/elsewhere --no-cache")
    assert compile_(config).key == first.key
    monkeypatch.setenv("NEURON_CC_FLAGS", "-O3")
    assert compile_(config).key != first.key


def test_neuron_contract_a_new_optimum_neuron_recompiles(sdk, config, tmp_path):
    from tests.neuron_fakes import write_dist_info

    first = compile_(config)
    write_dist_info(tmp_path / "neuron-site", {"optimum-neuron": "0.4.6"})
    import shutil

    shutil.rmtree(tmp_path / "neuron-site" / "optimum_neuron-0.4.5.dist-info")
    backends._instances.clear()
    second = compile_(config)
    assert second.status == "compiled" and second.key != first.key
    assert second.material["versions"]["optimum-neuron"] == "0.4.6"


def test_neuron_contract_wrong_dtype_in_the_export_fails_the_bucket(sdk, config, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON_MODE", "wrong-dtype")
    result = compile_(config)
    assert result.status == "failed"
    assert "torch_dtype 'bfloat16' (expected 'float32')" in result.error


def test_neuron_contract_missing_optimum_neuron_is_unavailable(sdk, tmp_path):
    import shutil

    shutil.rmtree(tmp_path / "neuron-site" / "optimum_neuron-0.4.5.dist-info")
    why = backends.get_backend("neuron").unavailable_reason()
    assert "has no optimum-neuron" in why and "optimum-neuron[neuronx]" in why


def test_neuron_contract_a_new_compiler_version_recompiles(sdk, config, monkeypatch):
    first = compile_(config)
    assert compile_(config).status == "cached"
    bin_dir = Path(os.environ["PATH"].split(os.pathsep)[0])
    cc = bin_dir / "neuronx-cc"
    cc.write_text(cc.read_text().replace(CC_VERSION, "2.16.0.0+deadbeef"))
    backends._instances.clear()
    second = compile_(config)
    assert second.status == "compiled" and second.key != first.key


def test_neuron_contract_nonzero_exit_fails_the_bucket_and_keeps_the_log(sdk, config, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON_MODE", "fail")
    result = compile_(config)
    assert result.status == "failed"
    assert "optimum-cli export neuron: exited with status 3" in result.error
    assert "out of memory compiling the graph" in result.log.read_text()
    assert read_cache_entry(open_store(str(config.parent / "store")), result.key) is None


def test_neuron_contract_success_without_the_output_files_is_a_failure(sdk, config, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON_MODE", "no-output")
    result = compile_(config)
    assert result.status == "failed"
    assert "succeeded but wrote no model.pt, neuron_config.json" in result.error


def test_neuron_contract_timeout_kills_the_compiler(sdk, config, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON_MODE", "hang")
    result = compile_(config, timeout_s=5)
    assert result.status == "timeout"
    pid = json.loads(sdk.read_text())["pid"]
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_neuron_contract_compiler_crash_is_reported(sdk, config, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON_MODE", "crash")
    result = compile_(config)
    assert result.status == "failed"
    assert "killed by signal SIGSEGV" in result.error


def test_neuron_contract_auto_picks_neuron_where_the_sdk_is(sdk):
    assert resolve_backend("auto") == "neuron"


def test_neuron_contract_placeholder_compiler_counts_as_missing(sdk, monkeypatch):
    monkeypatch.setenv("FAKE_NEURONX_CC_BROKEN", "1")
    assert "neuronx-cc --version" in backends.get_backend("neuron").unavailable_reason()


def test_neuron_contract_missing_sdk_is_one_clear_line(config, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    r = CliRunner().invoke(app, ["compile", str(config)])
    assert r.exit_code == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: backend 'neuron': optimum-cli and neuronx-cc not found")
    assert "pip.repos.neuron.amazonaws.com" in line
