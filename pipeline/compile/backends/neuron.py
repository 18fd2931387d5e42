"""neuron backend: an adapter around AWS's documented command-line tools.

Per bucket it runs::

    optimum-cli export neuron --model DIR --task text-generation --batch_size B \\
        --sequence_length S --num_cores TP --auto_cast_type TYPE --torch_dtype DTYPE OUT

with the config's compiler flags (all but ``inductor.*``) in ``NEURON_CC_FLAGS``, which
neuronx-cc reads. Its output (``model.pt`` with the compiled graphs, ``neuron_config.json``,
``config.json``, and whatever else the exporter writes) becomes the bucket's files; its
stdout and stderr are the bucket's log. ``neuronx-cc --version`` goes into the cache key.

The Neuron SDK is not on PyPI (the PyPI names are placeholders) and cannot run in this
repository's CI: the backend is tested against this contract with stand-in executables.
Heads are not padded here: Neuron's tooling applies the GQA rules itself for ``--num_cores``.
``--torch_dtype`` is the config's model.dtype; auto_cast_type fp32, which the exporter does
not take as a cast type, becomes ``--auto_cast none``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

from pipeline.compile.backends.base import Backend, BucketJob, BucketOutput
from pipeline.errors import PipelineError

EXPORTER = "optimum-cli"
COMPILER = "neuronx-cc"
REQUIRED_OUTPUTS = ("model.pt", "neuron_config.json")
INSTALL_HINT = (
    "install the AWS Neuron SDK from AWS's package repository, not PyPI: pip install "
    "--extra-index-url https://pip.repos.neuron.amazonaws.com neuronx-cc torch-neuronx "
    "optimum-neuron (on an inf2/trn1 host or any x86-64 Linux build machine)"
)
VERSION_TIMEOUT_S = 120


def neuron_flags(flags: tuple[str, ...] | list[str]) -> list[str]:
    """The config flags meant for neuronx-cc (``inductor.*`` flags are the cpu/cuda ones)."""
    return [f for f in flags if not f.startswith("inductor.")]


def export_command(job: BucketJob, out: Path) -> list[str]:
    # The exporter casts to bf16/fp16/tf32; "fp32" in our config means no casting at all.
    cast = (
        ["--auto_cast", "none"]
        if job.auto_cast_type == "fp32"
        else ["--auto_cast_type", job.auto_cast_type]
    )
    return [
        EXPORTER,
        "export",
        "neuron",
        "--model",
        str(job.model_dir),
        "--task",
        "text-generation",
        "--batch_size",
        str(job.bucket.batch),
        "--sequence_length",
        str(job.bucket.seq),
        "--num_cores",
        str(job.tp),
        *cast,
        "--torch_dtype",
        job.dtype,  # the config's model.dtype (the exporter's default is float32)
        str(out),
    ]


class NeuronBackend(Backend):
    name = "neuron"
    wants_padded_checkpoint = False
    # The exporter's output holds the sharded weights (checkpoint/weights/) and a copy of
    # config.json beside model.pt. model.pt itself is weight-free (NxD model_builder.py:1751,
    # inline_weights_to_neff=False), but sharding new weights for it needs NxD's
    # shard_checkpoint (optimum-neuron 0.4.5 pretrained_model.py:164-177), i.e. the Neuron
    # SDK, which cannot run here: weights stay in the graph key (docs/finetune.md).
    graphs_depend_on_weights = True

    def __init__(self) -> None:
        self._version: str | None = None

    def unavailable_reason(self) -> str | None:
        missing = [t for t in (EXPORTER, COMPILER) if shutil.which(t) is None]
        if missing:
            return f"{' and '.join(missing)} not found on PATH; {INSTALL_HINT}"
        try:
            self.compiler_version()
        except PipelineError as e:
            return f"{e.one_line()}; {INSTALL_HINT}"
        return None

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

    def versions(self) -> dict[str, str]:
        return {COMPILER: self.compiler_version()}

    def compile(self, job: BucketJob) -> BucketOutput:
        out = job.out_dir
        argv = export_command(job, out)
        flags = shlex.join(neuron_flags(job.flags))
        env = {**os.environ, "NEURON_CC_FLAGS": flags}
        print(f"$ NEURON_CC_FLAGS={shlex.quote(flags)} {shlex.join(argv)}", flush=True)
        # stdout/stderr are inherited: the compiler's output is this bucket's log.
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
        files = {p.relative_to(out).as_posix(): p for p in sorted(out.rglob("*")) if p.is_file()}
        meta = {COMPILER: self.compiler_version(), "command": argv, "NEURON_CC_FLAGS": flags}
        return BucketOutput(files=files, meta=meta)
