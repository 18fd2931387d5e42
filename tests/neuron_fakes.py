"""Stand-ins for the Neuron SDK's executables and packages (no Neuron SDK runs here).

``install_fake_sdk(dir, monkeypatch)`` puts on PATH an ``optimum-cli`` and a ``neuronx-cc``
that behave like optimum-neuron 0.4.5's decoder export as far as this pipeline can see it,
and on PYTHONPATH package metadata (``*.dist-info``) of the distributions whose versions the
backend records. The exporter stand-in:

* parses its arguments with the flag names of upstream's parser (which the real parser checks
  in tests/test_neuron_upstream.py), ``--instance_type`` required as on a host without a device;
* takes the dtype from the checkpoint's config.json ``dtype`` (or ``torch_dtype``) only, and
  refuses a model_type upstream has not registered, as upstream does;
* writes config.json, neuron_config.json (upstream's field names), model.pt (bucket-specific
  bytes) and checkpoint/weights/tp{r}_sharded_checkpoint.safetensors (bytes that depend only
  on the weights, dtype and rank, so buckets share them), and the tokenizer files.

It records its argv and environment in $FAKE_NEURON_RECORD and behaves as $FAKE_NEURON_MODE
says: ok, fail (exit 3), no-output (exit 0, nothing written), hang, crash (SIGSEGV),
wrong-dtype (writes a neuron_config.json with another dtype).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.config_factory import release_yaml

CC_VERSION = "2.21.33363.0+82129205"
VERSIONS = {
    "optimum-neuron": "0.4.5",
    "neuronx-distributed": "0.15.22404",
    "torch-neuronx": "2.8.0.2.10.16998",
    "libneuronxla": "2.2.12677.0",
    "transformers": "4.57.6",
}

OPTIMUM_CLI = r"""#!{python}
import argparse, hashlib, json, os, shutil, signal, sys, time
from pathlib import Path

REGISTERED = ["granite", "llama", "llama4_text", "mixtral", "phi3", "qwen2", "qwen3",
              "qwen3_moe", "smollm3"]
mode = os.environ.get("FAKE_NEURON_MODE", "ok")
record = {"argv": sys.argv[1:], "NEURON_CC_FLAGS": os.environ.get("NEURON_CC_FLAGS"),
          "NEURON_COMPILE_CACHE_URL": os.environ.get("NEURON_COMPILE_CACHE_URL"),
          "pid": os.getpid()}
Path(os.environ["FAKE_NEURON_RECORD"]).write_text(json.dumps(record))
assert sys.argv[1:3] == ["export", "neuron"], sys.argv
p = argparse.ArgumentParser("optimum-cli export neuron")
p.add_argument("-m", "--model", required=True)
p.add_argument("output", type=Path)
p.add_argument("--task", default="auto")
p.add_argument("--instance_type", choices=["trn1", "inf2", "trn1n", "trn2"], required=True)
p.add_argument("--tensor_parallel_size", type=int, default=1)
p.add_argument("--batch_size", type=int)
p.add_argument("--sequence_length", type=int)
a = p.parse_args(sys.argv[3:])
print("Compiler status PASS" if mode == "ok" else f"stand-in mode {mode}", flush=True)
if mode == "fail":
    print("neuronx-cc: error: out of memory compiling the graph", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    time.sleep(3600)
if mode == "crash":
    os.kill(os.getpid(), signal.SIGSEGV)
if mode == "no-output":
    sys.exit(0)
src = Path(a.model)
config = json.loads((src / "config.json").read_text())
if config.get("model_type") not in REGISTERED:
    sys.exit(f"ValueError: Model type {config.get('model_type')} is not supported")
dtype = config.get("dtype") or config.get("torch_dtype")
if dtype is None:
    sys.exit("ValueError: Unable to find None in the dtype mapping")
out = a.output
out.mkdir(parents=True, exist_ok=True)
nc = {"_serialized_key": "NxDNeuronConfig", "batch_size": a.batch_size,
      "sequence_length": a.sequence_length, "tp_degree": a.tensor_parallel_size,
      "torch_dtype": {"float32": "bfloat16"}.get(dtype, "float32") if mode == "wrong-dtype"
      else dtype,
      "target": "trn1" if a.instance_type == "inf2" else a.instance_type,
      "continuous_batching": a.batch_size > 1, "on_device_sampling": True,
      "optimum_neuron_version": "0.4.5", "neuronxcc_version": "{cc_version}"}
(out / "neuron_config.json").write_text(json.dumps(nc, indent=2, sort_keys=True))
(out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
(out / "model.pt").write_bytes(
    f"graphs b{a.batch_size} s{a.sequence_length} tp{a.tensor_parallel_size}".encode())
weights = b"".join(f.read_bytes() for f in sorted(src.glob("*.safetensors")))
shards = out / "checkpoint" / "weights"
shards.mkdir(parents=True)
for r in range(a.tensor_parallel_size):
    h = hashlib.sha256(weights + f"{dtype} {r}/{a.tensor_parallel_size}".encode()).digest()
    (shards / f"tp{r}_sharded_checkpoint.safetensors").write_bytes(h * 64)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    if (src / name).is_file():
        shutil.copy(src / name, out / name)
"""

NEURONX_CC = r"""#!{python}
import os, sys
if os.environ.get("FAKE_NEURONX_CC_BROKEN"):
    print("ImportError: this is a placeholder package", file=sys.stderr)
    sys.exit(1)
assert sys.argv[1:] == ["--version"], sys.argv
print("NeuronX Compiler version {cc_version}")
print("Python version 3.10.12")
"""


def install_fake_sdk(root: Path, monkeypatch, versions: dict[str, str] | None = None) -> Path:
    """The stand-ins under ``root``, on PATH and PYTHONPATH; returns the record file."""
    bin_dir = root / "neuron-bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("optimum-cli", OPTIMUM_CLI), ("neuronx-cc", NEURONX_CC)):
        path = bin_dir / name
        text = text.replace("{python}", sys.executable).replace("{cc_version}", CC_VERSION)
        path.write_text(text)
        path.chmod(0o755)
    write_dist_info(root / "neuron-site", versions or VERSIONS)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    old = os.environ.get("PYTHONPATH")
    site = str(root / "neuron-site")
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{old}" if old else site)
    record = root / "record.json"
    monkeypatch.setenv("FAKE_NEURON_RECORD", str(record))
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    return record


def write_dist_info(site: Path, versions: dict[str, str]) -> None:
    """Package metadata that importlib.metadata finds (what the backend's probe reads)."""
    for name, version in versions.items():
        d = site / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


# --- A neuron release made with these stand-ins, and the stand-in runtime -----------------

STANDIN = Path(__file__).resolve().parent / "neuron_standin"


@pytest.fixture(scope="module")
def neuron_release(tiny_checkpoint, tmp_path_factory):
    """(store dir, DEST/MODEL) of the tiny model compiled for neuron by the stand-in exporter."""
    from pipeline.compile import backends
    from pipeline.compile.release import publish_release
    from pipeline.compile.scheduler import compile_release
    from pipeline.install.pull import pull_release
    from pipeline.plan.config import load_config
    from pipeline.store import open_store

    root = tmp_path_factory.mktemp("neuron-release")
    config = root / "release.yaml"
    config.write_text(
        release_yaml(
            name="tiny-neuron",
            checkpoint=tiny_checkpoint,
            backend="neuron",
            sequence_lengths=[16, 32, 64],
            flags=["-O1"],
            timeout_s=120,
        )
    )
    with pytest.MonkeyPatch.context() as mp:
        install_fake_sdk(root, mp)
        backends._instances.clear()
        release = load_config(config)
        report = compile_release(release, jobs=2, workdir=root / "work")
        assert not report.failed, [(r.bucket.name, r.error) for r in report.failed]
        version = publish_release(release, version="v1").version
        backends._instances.clear()
    pull_release(open_store(str(root / "store")), release.name, root / "models", version=version)
    return root / "store", root / "models" / release.name


@pytest.fixture
def standin(monkeypatch):
    """The stand-in optimum.neuron first on sys.path, its call log empty."""
    for name in [m for m in sys.modules if m == "optimum" or m.startswith("optimum.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(STANDIN))
    import optimum.neuron as module

    assert module.__file__.startswith(str(STANDIN))
    module.CALLS.clear()
    yield module
    # Imported here, so not restored by monkeypatch: later tests must not find the stand-in.
    for name in [m for m in sys.modules if m == "optimum" or m.startswith("optimum.")]:
        del sys.modules[name]
    import gc

    gc.collect()
