"""neuron backend: an adapter around optimum-neuron's exporter (``optimum-cli export neuron``).

Once per run (``prepare``) it writes the checkpoint the exporter reads: the config.json whose
``dtype`` is the release's (optimum-neuron takes a decoder's dtype from there and nowhere
else), with a Mistral without sliding window rewritten as Llama, the weights cast when their
dtype differs, every other file hard-linked. Per bucket it runs::

    optimum-cli export neuron --model CKPT --task text-generation --batch_size B \\
        --sequence_length S --tensor_parallel_size TP --instance_type FAMILY OUT

with the config's compiler flags (all but ``inductor.*``) appended to the user's
``NEURON_CC_FLAGS``; ``NEURON_COMPILE_CACHE_URL`` passes through to the Neuron compile cache.
The export (``model.pt`` with the compiled graphs, ``neuron_config.json``, ``config.json``,
``checkpoint/weights/tp{r}_sharded_checkpoint.safetensors``, tokenizer files) becomes the
bucket's files, after its ``neuron_config.json`` is checked against the bucket, tp and dtype.

Every argument is checked against optimum-neuron 0.4.5's own parser (tests/test_neuron_upstream.py);
the exporter itself never runs in this repository's CI (the Neuron SDK is not on PyPI): the
backend is tested against this contract with stand-in executables.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.compile.backends.base import Backend, BucketJob, BucketOutput
from pipeline.errors import PipelineError
from pipeline.plan.checkpoint import neuron_export_config, read_config
from pipeline.plan.instances import neuron_family

EXPORTER = "optimum-cli"
COMPILER = "neuronx-cc"
REQUIRED_OUTPUTS = ("model.pt", "neuron_config.json")
INSTALL_HINT = (
    "install the Neuron SDK with optimum-neuron from AWS's package repository, not PyPI: pip "
    "install --extra-index-url https://pip.repos.neuron.amazonaws.com 'optimum-neuron[neuronx]"
    "==0.4.5' (on an inf2/trn1 host or any x86-64 Linux build machine)"
)
VERSION_TIMEOUT_S = 120
# Distributions whose versions decide whether an export loads. neuron_config.json records
# optimum_neuron_version and neuronxcc_version, and loading raises unless both equal the
# installed ones (optimum/neuron/configuration_utils.py:229-240); model.pt holds TorchScript
# classes of torch-neuronx; the sharding and graph builders are rebuilt at load from
# neuronx-distributed; transformers parses config.json. neuronx-cc comes from its --version.
DISTRIBUTIONS = (
    "optimum-neuron",
    "neuronx-distributed",
    "torch-neuronx",
    "libneuronxla",
    "transformers",
)
# Bump when what prepare hands the exporter changes (e.g. the Mistral-as-Llama rewrite).
EXPORT_FORMAT = 2
# optimum-neuron reads these from NEURON_CC_FLAGS for its cache location only
# (optimum/neuron/utils/cache_utils.py:208-221): they do not change the compiled graphs.
CACHE_FLAGS = re.compile(r"^--(cache_dir=.*|no-cache)$")
CHECKPOINT = "checkpoint"  # prepare's output: the directory the exporter reads
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
PROBE = (
    "import importlib.metadata as m, json, sys\n"
    "out = {}\n"
    "for d in sys.argv[1:]:\n"
    "    try: out[d] = m.version(d)\n"
    "    except m.PackageNotFoundError: pass\n"
    "print(json.dumps(out))\n"
)


def neuron_flags(flags: tuple[str, ...] | list[str]) -> list[str]:
    """The config flags meant for neuronx-cc (``inductor.*`` flags are the cpu/cuda ones)."""
    return [f for f in flags if not f.startswith("inductor.")]


def cc_flags(config_flags: tuple[str, ...] | list[str], user: str | None) -> str:
    """The user's NEURON_CC_FLAGS (e.g. ``--cache_dir=``, ``--no-cache``, which optimum-neuron
    reads from it) with the config's flags appended, never replaced."""
    return " ".join(p for p in ((user or "").strip(), shlex.join(neuron_flags(config_flags))) if p)


def export_command(job: BucketJob, model_dir: Path, out: Path) -> list[str]:
    """The exporter's argv. Flag names are those of optimum-neuron 0.4.5's parser
    (optimum/commands/export/neuronx.py): --instance_type is required on a host without a
    Neuron device (48-56), --tensor_parallel_size (123-128; --num_cores is a hidden deprecated
    alias, 134-141). No --torch_dtype/--auto_cast*: decoders ignore them
    (exporters/neuron/__main__.py:740-749; models/inference/backend/pretrained_model.py:329-330)."""
    return [
        EXPORTER,
        "export",
        "neuron",
        "--model",
        str(model_dir),
        "--task",
        "text-generation",
        "--batch_size",
        str(job.bucket.batch),
        "--sequence_length",
        str(job.bucket.seq),
        "--tensor_parallel_size",
        str(job.tp),
        "--instance_type",
        neuron_family(job.instance_type),
        str(out),  # the positional output; the CLI joins argv unquoted, so no spaces in paths
    ]


def write_export_checkpoint(src: Path, dest: Path, dtype: str) -> Path:
    """``src`` as the exporter must see it: config.json with ``dtype`` (and the legacy
    ``torch_dtype``) = the release's, Mistral rewritten as Llama, weights cast to ``dtype``
    where they differ, everything else hard-linked. Written under a temporary name."""
    config = neuron_export_config(read_config(src), str(src))
    # optimum-neuron: get_neuron_config takes dtype=config.dtype (modeling_utils.py:141), and
    # transformers reads config.json "dtype" or the legacy "torch_dtype" into it.
    config.update(dtype=dtype, torch_dtype=dtype)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.incomplete")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for path in sorted(src.iterdir()):
            if not path.is_file() or path.name == "config.json":
                continue
            if path.suffix == ".safetensors" and _safetensors_needs_cast(path, dtype):
                _cast_safetensors(path, tmp / path.name, dtype)
            elif path.suffix == ".bin" and path.name.startswith("pytorch_model"):
                _cast_torch_bin(path, tmp / path.name, dtype)
            else:
                _link(path, tmp / path.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _safetensors_needs_cast(path: Path, dtype: str) -> bool:
    """Whether a floating tensor of the file is not in ``dtype`` (reads only the header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    want = SAFETENSORS_DTYPE[dtype]
    return any(
        t["dtype"] in FLOAT_DTYPES and t["dtype"] != want
        for name, t in header.items()
        if name != "__metadata__"
    )


def _cast_safetensors(src: Path, dest: Path, dtype: str) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    to = getattr(torch, dtype)
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
        tensors = {
            k: (t.to(to) if t.is_floating_point() else t)
            for k in f.keys()  # noqa: SIM118 - safe_open has no __iter__
            for t in [f.get_tensor(k)]
        }
    save_file(tensors, str(dest), metadata=meta or {"format": "pt"})


def _cast_torch_bin(src: Path, dest: Path, dtype: str) -> None:
    import torch

    to = getattr(torch, dtype)
    state = torch.load(src, weights_only=True, map_location="cpu")
    if all(not t.is_floating_point() or t.dtype == to for t in state.values()):
        _link(src, dest)
        return
    torch.save({k: (t.to(to) if t.is_floating_point() else t) for k, t in state.items()}, dest)


def _link(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another filesystem
        shutil.copy2(src, dest)


def exporter_python() -> str:
    """The interpreter ``optimum-cli`` runs with (its shebang), where the versions that
    matter are installed; this interpreter when that cannot be read."""
    path = shutil.which(EXPORTER)
    try:
        first = Path(path).read_bytes()[:256].split(b"\n", 1)[0].decode() if path else ""
    except OSError:
        first = ""
    if not first.startswith("#!"):
        return sys.executable
    parts = first[2:].split()
    if parts and parts[0].endswith("/env") and len(parts) > 1:
        return shutil.which(parts[1]) or sys.executable
    return parts[0] if parts else sys.executable


class NeuronBackend(Backend):
    name = "neuron"
    wants_padded_checkpoint = False  # NxD applies its own GQA sharding for the tp degree
    # The exporter's output holds the sharded weights (checkpoint/weights/) and a copy of
    # config.json beside model.pt. model.pt itself is weight-free (NxD model_builder.py:1751,
    # inline_weights_to_neff=False), but sharding new weights for it needs NxD's
    # shard_checkpoint (optimum-neuron 0.4.5 pretrained_model.py:164-177), i.e. the Neuron
    # SDK, which cannot run here: weights stay in the graph key (docs/finetune.md).
    graphs_depend_on_weights = True

    def __init__(self) -> None:
        self._version: str | None = None
        self._versions: dict[str, str] | None = None

    def unavailable_reason(self) -> str | None:
        missing = [t for t in (EXPORTER, COMPILER) if shutil.which(t) is None]
        if missing:
            return f"{' and '.join(missing)} not found on PATH; {INSTALL_HINT}"
        try:
            self.versions()
        except PipelineError as e:
            return f"{e.one_line()}; {INSTALL_HINT}"
        return None

    def check_model(self, checkpoint: Path) -> None:
        neuron_export_config(read_config(checkpoint), str(checkpoint))

    def compiler_version(self) -> str:
        """``neuronx-cc --version``, parsed to the version number (run once per process)."""
        if self._version is None:
            try:
                done = subprocess.run(
                    [COMPILER, "--version"],
                    capture_output=True,
                    text=True,
                    timeout=VERSION_TIMEOUT_S,
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                raise PipelineError(f"{COMPILER} --version", f"could not run: {e}") from None
            text = (done.stdout + done.stderr).strip()
            if done.returncode != 0 or not text:
                raise PipelineError(
                    f"{COMPILER} --version", f"exited with {done.returncode}: {text[-200:]}"
                )
            m = re.search(r"version\s*[:=]?\s*v?(\d[\w.+-]*)", text, re.IGNORECASE)
            self._version = m[1] if m else text.splitlines()[0]
        return self._version

    def library_versions(self) -> dict[str, str]:
        """The DISTRIBUTIONS' versions in the exporter's environment (run once per process)."""
        if self._versions is None:
            python = exporter_python()
            try:
                done = subprocess.run(
                    [python, "-c", PROBE, *DISTRIBUTIONS],
                    capture_output=True,
                    text=True,
                    timeout=VERSION_TIMEOUT_S,
                )
                found = json.loads(done.stdout) if done.returncode == 0 else None
            except (OSError, subprocess.TimeoutExpired, ValueError) as e:
                raise PipelineError(f"{python}", f"could not read package versions: {e}") from None
            if not isinstance(found, dict):
                raise PipelineError(
                    f"{python}", f"could not read package versions: {done.stderr[-200:]}"
                )
            missing = [d for d in DISTRIBUTIONS if d not in found]
            if missing:
                raise PipelineError(
                    f"the exporter's Python ({python})", f"has no {', '.join(missing)}"
                )
            self._versions = {d: str(found[d]) for d in DISTRIBUTIONS}
        return self._versions

    def versions(self) -> dict[str, str]:
        return {COMPILER: self.compiler_version(), **self.library_versions()}

    def key_options(
        self, flags: tuple[str, ...] | list[str], instance_type: str | None = None
    ) -> dict[str, Any]:
        user = shlex.split(os.environ.get("NEURON_CC_FLAGS", ""))
        return {
            "export_format": EXPORT_FORMAT,
            # --instance_type decides the compile target (inf2 and trn1 both compile for
            # trn1: optimum/neuron/utils/instance.py:25-47; trn2 does not load on inf2).
            "instance_family": neuron_family(instance_type) if instance_type else None,
            # The user's compiler flags change the graphs; its cache flags do not.
            "user_cc_flags": [f for f in user if not CACHE_FLAGS.match(f)],
        }

    def prepare(self, model_dir: Path, dtype: str, out_dir: Path) -> dict[str, Path]:
        return {CHECKPOINT: write_export_checkpoint(model_dir, out_dir / CHECKPOINT, dtype)}

    def compile(self, job: BucketJob) -> BucketOutput:
        out = job.out_dir
        model_dir = job.shared.get(CHECKPOINT) or write_export_checkpoint(
            job.model_dir, out.parent / f"{out.name}.checkpoint", job.dtype
        )
        argv = export_command(job, model_dir, out)
        flags = cc_flags(job.flags, os.environ.get("NEURON_CC_FLAGS"))
        env = {**os.environ, "NEURON_CC_FLAGS": flags}  # NEURON_COMPILE_CACHE_URL passes on
        cache = os.environ.get("NEURON_COMPILE_CACHE_URL")
        print(f"# NEURON_COMPILE_CACHE_URL={cache or '(unset: the local default)'}", flush=True)
        print(f"$ NEURON_CC_FLAGS={shlex.quote(flags)} {shlex.join(argv)}", flush=True)
        # stdout/stderr are inherited: the exporter's output is this bucket's log.
        code = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode
        if code != 0:
            why = (
                f"killed by signal {signal.Signals(-code).name}"
                if code < 0
                else f"exited with status {code}"
            )
            raise PipelineError(f"{EXPORTER} export neuron", why, "see the compiler log above")
        missing = [name for name in REQUIRED_OUTPUTS if not (out / name).is_file()]
        if missing:
            raise PipelineError(
                f"{EXPORTER} export neuron",
                f"succeeded but wrote no {', '.join(missing)} in {out}",
                "check the optimum-neuron version against the documented export layout",
            )
        check_export(out / "neuron_config.json", job)
        files = {p.relative_to(out).as_posix(): p for p in sorted(out.rglob("*")) if p.is_file()}
        meta = {"command": argv, "NEURON_CC_FLAGS": flags}
        return BucketOutput(files=files, meta=meta)


def check_export(path: Path, job: BucketJob) -> None:
    """The export is what was asked for: neuron_config.json's batch_size, sequence_length,
    tp_degree and torch_dtype (field names: optimum/neuron/models/inference/backend/config.py
    43-130) against the bucket, tp and the release's dtype."""
    try:
        nc = json.loads(path.read_text())
    except ValueError as e:
        raise PipelineError(str(path), f"not valid JSON: {e}") from None
    want = {
        "batch_size": job.bucket.batch,
        "sequence_length": job.bucket.seq,
        "tp_degree": job.tp,
        "torch_dtype": job.dtype,
    }
    wrong = [f"{k} {nc.get(k)!r} (expected {v!r})" for k, v in want.items() if nc.get(k) != v]
    if wrong:
        raise PipelineError(
            f"{EXPORTER} export neuron",
            f"neuron_config.json has {', '.join(wrong)}",
            "the export does not match the release config; check the exporter's version",
        )
