"""The neuron backend against the documented CLI contract, with stand-in executables.

No Neuron SDK runs here: ``optimum-cli`` and ``neuronx-cc`` are small scripts these tests put
on PATH. They record how they were called and behave as told by FAKE_NEURON_MODE: ok, fail
(exit 3), no-output (exit 0, write nothing), hang, crash (SIGSEGV). What they check is our
side of the contract: arguments, environment, exit codes, output files, timeout, logs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.compile import backends
from pipeline.compile.backends import resolve_backend
from pipeline.compile.runner import compile_release
from pipeline.plan.config import load_config
from pipeline.store import open_store
from pipeline.store.cache import read_cache_entry

pytestmark = pytest.mark.contract

VERSION = "2.15.128.0+56dc5a86"
CONFIG = """
model:
  name: tiny
  checkpoint: {ckpt}
  dtype: bfloat16
target:
  backend: neuron
  instance_type: inf2.24xlarge
  tp_degree: 4
buckets:
  batch_sizes: [2]
  sequence_lengths: [64]
compiler:
  flags: ["--model-type=transformer", "-O1", "inductor.max_autotune=true"]
  auto_cast_type: bf16
  timeout_s: 60
store: store
"""
OPTIMUM_CLI = r"""#!{python}
import json, os, signal, sys, time
from pathlib import Path
mode = os.environ.get("FAKE_NEURON_MODE", "ok")
out = Path(sys.argv[-1])
record = {"argv": sys.argv[1:], "NEURON_CC_FLAGS": os.environ.get("NEURON_CC_FLAGS"),
          "pid": os.getpid()}
Path(os.environ["FAKE_NEURON_RECORD"]).write_text(json.dumps(record))
print("Compiler status PASS" if mode == "ok" else f"stand-in mode {mode}", flush=True)
if mode == "fail":
    print("neuronx-cc: error: out of memory compiling the graph", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    time.sleep(3600)
if mode == "crash":
    os.kill(os.getpid(), signal.SIGSEGV)
if mode == "ok":
    out.mkdir(parents=True, exist_ok=True)
    batch = sys.argv[sys.argv.index("--batch_size") + 1]
    (out / "model.pt").write_bytes(f"neff graphs for batch {batch}".encode())
    (out / "neuron_config.json").write_text(json.dumps({"tp_degree": 4}))
    (out / "config.json").write_text("{}")
    (out / "checkpoint" / "weights").mkdir(parents=True)
    (out / "checkpoint" / "weights" / "tp0_sharded_checkpoint.safetensors").write_bytes(b"w")
"""
NEURONX_CC = r"""#!{python}
import os, sys
if os.environ.get("FAKE_NEURONX_CC_BROKEN"):
    print("ImportError: this is a placeholder package", file=sys.stderr)
    sys.exit(1)
assert sys.argv[1:] == ["--version"], sys.argv
print("NeuronX Compiler version {version}")
print("Python version 3.10.12")
"""


@pytest.fixture(autouse=True)
def fresh_backends(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default workdir (work/compile/<model>) lands here
    backends._instances.clear()  # the compiler version is remembered per instance
    yield
    backends._instances.clear()


@pytest.fixture
def sdk(tmp_path, monkeypatch) -> Path:
    """Stand-ins for the Neuron SDK on PATH; returns the file the exporter records into."""
    bin_dir = tmp_path / "neuron-bin"
    bin_dir.mkdir()
    for name, text in (("optimum-cli", OPTIMUM_CLI), ("neuronx-cc", NEURONX_CC)):
        path = bin_dir / name
        path.write_text(text.replace("{python}", sys.executable).replace("{version}", VERSION))
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_NEURON_RECORD", str(record))
    return record


@pytest.fixture
def config(write_config) -> Path:
    return write_config(CONFIG)


def compile_(config: Path, **kw):
    (result,) = compile_release(load_config(config), workdir=config.parent / "work", **kw).results
    return result


def test_neuron_contract_arguments_environment_and_outputs(sdk, config, tiny_checkpoint):
    result = compile_(config)
    assert result.status == "compiled", result.error
    call = json.loads(sdk.read_text())
    assert call["argv"][:-1] == [
        "export",
        "neuron",
        "--model",
        str(tiny_checkpoint),  # the original checkpoint: Neuron's tooling pads heads itself
        "--task",
        "text-generation",
        "--batch_size",
        "2",
        "--sequence_length",
        "64",
        "--num_cores",
        "4",
        "--auto_cast_type",
        "bf16",
        "--torch_dtype",
        "bfloat16",
    ]
    assert call["NEURON_CC_FLAGS"] == "--model-type=transformer -O1"  # inductor.* left out
    store = open_store(str(config.parent / "store"))
    entry = read_cache_entry(store, result.key)
    assert {f.path for f in entry.files} == {
        "model.pt",
        "neuron_config.json",
        "config.json",
        "checkpoint/weights/tp0_sharded_checkpoint.safetensors",
    }
    assert entry.meta["log"]["path"] == "compile.log" and entry.meta["log"]["size"] > 0
    assert entry.meta["versions"] == {"neuronx-cc": VERSION}
    assert entry.meta["key_material"]["versions"] == {"neuronx-cc": VERSION}
    log = result.log.read_text()
    assert "Compiler status PASS" in log and "NEURON_CC_FLAGS=" in log


def test_neuron_contract_fp32_means_no_auto_cast(tmp_path):
    from pipeline.compile.backends.base import BucketJob
    from pipeline.compile.backends.neuron import export_command
    from pipeline.plan.buckets import Bucket

    job = BucketJob(tmp_path, Bucket(1, 128), 2, {}, "float32", (), "fp32", tmp_path / "out")
    argv = export_command(job, tmp_path / "out")
    assert "--auto_cast_type" not in argv
    assert argv[argv.index("--auto_cast") + 1] == "none"
    assert argv[argv.index("--torch_dtype") + 1] == "float32"


def test_neuron_contract_a_new_compiler_version_recompiles(sdk, config, monkeypatch):
    first = compile_(config)
    assert compile_(config).status == "cached"
    bin_dir = Path(os.environ["PATH"].split(os.pathsep)[0])
    cc = bin_dir / "neuronx-cc"
    cc.write_text(cc.read_text().replace(VERSION, "2.16.0.0+deadbeef"))
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
    result = compile_(config, timeout_s=2)
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
