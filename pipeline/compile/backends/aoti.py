"""cpu and cuda backends: ``torch.export`` + AOTInductor, a prefill and a decode package.

Per bucket: export ``decoder.Prefill`` at each of the bucket's prefill lengths and
``decoder.Decode``, with static shapes (but for the number of cache positions decode attends,
a dynamic size), compile each with ``aoti_compile_and_package`` into ``prefill.pt2`` (the
bucket's length), ``prefill_<T>.pt2`` (shorter prefill lengths) and ``decode.pt2``, and
describe them in ``graph.json`` (``pipeline.contracts.graph_abi``). Weights stay out of the packages
(``package_constants_in_so=False``): ``prepare`` writes them once per release into
``weights.safetensors``, shared by every bucket and cached under the weights key, and export
runs on uninitialised tensors, so the packages do not depend on the weights
(``graphs_depend_on_weights`` is False; docs/finetune.md).

Config flags of the form ``inductor.<option>=<value>`` (JSON value, e.g.
``inductor.max_autotune=true``) set torch._inductor options; other flags are Neuron
compiler flags and are ignored here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.compile.backends import pdl, tuning
from pipeline.compile.backends.base import Backend, BucketJob, BucketOutput
from pipeline.contracts import backend_table
from pipeline.contracts.bucket import Bucket, mixed_lengths, prefill_lengths
from pipeline.contracts.checkpoint_layout import fuse_checkpoint
from pipeline.contracts.graph_abi import (
    DECODE_FILE,
    GRAPH_FILE,
    MIXED_FILE,
    WEIGHTS_FILE,
    GraphSpec,
    cuda_arch,
    prefill_file,
)
from pipeline.errors import CheckpointError, InputError
from pipeline.plan.checkpoint import read_checkpoint

FLAG_PREFIX = "inductor."
# The stream length a mixed graph is traced at (its length is dynamic): about the current
# replay's folded calls, two or three ~70-token prompts, so dynamic-shape tuning aims there.
MIXED_TRACED = 256
# Options every package needs (part of the cache key through key_options).
BASE_OPTIONS: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}
# CPU: the C++ wrapper dominates compile time and is not on the hot path, so build it at
# -O0 without line tables; kernels keep -O3. On x86-64, target x86-64-v3 (AVX2, FMA) rather
# than -march=native, so packages built on a CI machine with AVX-512 run on any modern CPU.
CPU_OPTIONS: dict[str, Any] = {
    "aot_inductor.compile_wrapper_opt_level": "O0",
    "aot_inductor.enable_line_tables": False,
}
X86_OPTIONS: dict[str, Any] = {"cpp.march": "x86-64-v3", "cpp.simdlen": 256}
# CUDA: tune each Triton kernel's launch parameters. At batch 1 decode is one matrix-vector
# product after another, and the tuned tiles stream weights faster (on an H200, a
# Llama-3.2-1B step went from 1.60 ms to 1.37 ms); it costs compile time only. And launch
# each kernel while the one before it drains (programmatic dependent launch, Hopper and
# newer; inductor leaves it out on older GPUs): see pdl.py.
CUDA_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": True, pdl.OPTION: True}
# Prefill graphs are matrix products over many tokens (cuBLAS, which that tuning does not
# touch) and are replayed as CUDA graphs by the runtime, so tuning their Triton kernels buys
# little and cost most of a long bucket's compile (an s2048 b32 bucket's prefill graphs were
# still tuning after 9 minutes on an H200). A flag setting the option explicitly wins.
CUDA_PREFILL_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": False}


def parse_flags(flags: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``inductor.KEY=VALUE`` flags → {KEY: value}; other flags are not ours."""
    out = {}
    for flag in flags:
        if not flag.startswith(FLAG_PREFIX):
            continue
        key, sep, raw = flag[len(FLAG_PREFIX) :].partition("=")
        if not sep or not key:
            raise InputError(
                f"compiler flag '{flag}'",
                "not of the form inductor.<option>=<value>",
                "e.g. inductor.max_autotune=true",
            )
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw  # a bare word: a string option such as O1
    return out


class AotiBackend(Backend):
    device = "cpu"
    prefill_per_length = True

    def mixed_lengths(self, bucket: Bucket, configured: Sequence[int] | None) -> tuple[int, ...]:
        longest = backend_table.mixed_longest(getattr(self, "name", ""))
        return mixed_lengths(bucket, configured, longest)

    def versions(self) -> dict[str, str]:
        return {p: metadata.version(p) for p in ("torch", "transformers")}

    def key_options(
        self, flags: tuple[str, ...] | list[str], instance_type: str | None = None
    ) -> dict[str, Any]:
        inductor, prefill = self.inductor_options(flags), self.prefill_options(flags)
        return {
            "inductor": inductor,
            # in the key only where it differs, so cpu keys stay what they were
            **({"inductor_prefill": prefill} if prefill != inductor else {}),
            "machine": platform.machine(),
            "cxx": cxx_identity(),
        }

    def inductor_options(self, flags: tuple[str, ...] | list[str]) -> dict[str, Any]:
        return {**self.default_options(), **parse_flags(flags)}

    def prefill_options(self, flags: tuple[str, ...] | list[str]) -> dict[str, Any]:
        """The options of the prefill packages: the bucket's, with the backend's prefill
        overrides where the flags do not set the same option."""
        given = parse_flags(flags)
        extra = {k: v for k, v in self.prefill_overrides().items() if k not in given}
        return {**self.inductor_options(flags), **extra}

    def default_options(self) -> dict[str, Any]:
        return dict(BASE_OPTIONS)

    def prefill_overrides(self) -> dict[str, Any]:
        return {}

    def prepare(self, model_dir: Path, dtype: str, out_dir: Path) -> dict[str, Path]:
        """Write ``weights.safetensors``: the checkpoint's tensors in ``dtype``, by name."""
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig

        from pipeline.compile import decoder as dec

        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = dec.Decoder(cfg)
        tied = dec.aliases(model)
        wanted = set(model.state_dict()) - set(tied) - {"rope_inv_freq"}
        state = fuse_checkpoint(read_checkpoint(model_dir))
        missing = sorted(wanted - set(state))
        unexpected = sorted(set(state) - wanted - set(tied))
        if missing or unexpected:
            raise CheckpointError(
                str(model_dir),
                f"weights do not match {cfg.model_type}: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}",
                "is config.json the checkpoint's own?",
            )
        target = getattr(torch, dtype)
        tensors = {k: state[k].to(target).contiguous() for k in sorted(wanted)}
        tensors["rope_inv_freq"] = dec.rope_frequencies(cfg)[0].contiguous()
        out = Path(out_dir) / WEIGHTS_FILE
        tmp = out.with_name(f".{out.name}.{os.getpid()}.incomplete")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.chmod(0o644)
        os.replace(tmp, out)
        return {WEIGHTS_FILE: out}

    def compile(self, job: BucketJob) -> BucketOutput:
        import torch
        from transformers import AutoConfig

        from pipeline.compile import decoder as dec

        torch._inductor.config.compile_threads = 1  # parallelism comes from --jobs
        cfg = AutoConfig.from_pretrained(job.model_dir)
        dtype = getattr(torch, job.dtype)
        with torch.device("meta"):
            model = dec.Decoder(cfg)  # only for the names of tied weights
        spec = GraphSpec(
            batch=job.bucket.batch,
            seq=job.bucket.seq,
            layers=cfg.num_hidden_layers,
            kv_heads=cfg.num_key_value_heads,
            head_dim=dec.head_dim(cfg),
            vocab=cfg.vocab_size,
            dtype=job.dtype,
            device=self.device,
            aliases=dec.aliases(model),
            cuda_arch=cuda_arch() if self.device == "cuda" else "",
            prefill_lengths=prefill_lengths(job.bucket, job.prefill_lengths),
            prefill_batch=job.bucket.batch,
        )
        mixed = self.mixed_lengths(job.bucket, job.mixed_lengths)
        spec = dataclasses.replace(spec, mixed_lengths=mixed)
        options = self.inductor_options(job.flags)
        # mixed graphs are prefill-sized products too (and replayed as CUDA graphs)
        prefill_options = self.prefill_options(job.flags)
        per_graph = {dec.Prefill: prefill_options, dec.Decode: options, dec.Mixed: prefill_options}
        seconds = {}
        cache = [torch.zeros(spec.cache_shape, dtype=dtype, device=self.device) for _ in "kv"]
        out = job.out_dir
        for name, graph, inputs, dynamic in self._graphs(spec, *cache):
            module = dec.build(cfg, dtype, self.device, graph)
            if not spec.constants:  # every graph takes the same constants
                spec = dataclasses.replace(spec, constants=constant_specs(module))
            if graph is dec.Prefill and spec.prefill_batch == 1 and dynamic is not None:
                inputs, dynamic = _one_prompt(inputs), None  # an earlier length fell back
            if graph is not dec.Mixed:
                spec, seconds[name] = self._build(
                    out / name, module, inputs, dynamic, spec, per_graph
                )
                continue
            # what the prefill and decode graphs could be made; and a mixed graph is only a
            # faster way to what they do, so one that cannot be built leaves its prompts to
            # be prefilled apart rather than fail a bucket that compiles without it
            inputs, dynamic = _as_built(spec, inputs, dynamic)
            try:
                spec, seconds[name] = self._build(
                    out / name, module, inputs, dynamic, spec, per_graph
                )
            except Exception as e:
                why = (str(e).splitlines() or [""])[0]
                print(f"{name}: not built ({type(e).__name__}: {why}); prompts are "
                      "prefilled apart", flush=True)  # fmt: skip
                (out / name).unlink(missing_ok=True)
                spec = dataclasses.replace(spec, mixed_lengths=())
        if spec.mixed_lengths:  # as many prompts as prefill takes, in the rows left free
            spec = dataclasses.replace(spec, mixed_batch=min(spec.prefill_batch, spec.batch - 1))
        (job.out_dir / GRAPH_FILE).write_text(spec.to_json())
        # No weights here: prepare() wrote them once, cached under the weights key.
        names = [
            *(prefill_file(n, spec.seq) for n in spec.prefill_lengths),
            DECODE_FILE,
            *((MIXED_FILE,) if spec.mixed_lengths else ()),
            GRAPH_FILE,
        ]
        files = {n: job.out_dir / n for n in names}
        return BucketOutput(
            files=files,
            meta={
                "device": self.device,
                "inductor_options": options,
                "prefill_inductor_options": per_graph[dec.Prefill],
                "graph_seconds": seconds,
            },
        )

    def _build(
        self,
        path: Path,
        module: Any,
        inputs: tuple,
        dynamic: Any,
        spec: GraphSpec,
        per_graph: dict[type, dict[str, Any]],
    ) -> tuple[GraphSpec, float]:
        """Export ``module`` (falling back to fixed sizes where export cannot make one
        dynamic, which the spec then records), compile it into ``path`` and check that it
        loads: the spec and the seconds it took."""
        import torch
        from torch._inductor import aoti_compile_and_package

        from pipeline.compile import decoder as dec

        graph, name = type(module), path.name
        start = time.monotonic()
        with torch.no_grad():
            try:
                program = torch.export.export(module, inputs, dynamic_shapes=dynamic, strict=False)
            except torch._dynamo.exc.UserError as e:
                if dynamic is None or graph is dec.Mixed:  # mixed: the sizes the others took
                    raise
                why = str(e).splitlines()[0]
                if graph is dec.Decode:
                    # An attention kernel whose inputs must be padded or aligned makes the
                    # attended length take fixed values: attend the whole bucket.
                    print(f"{name}: attends the whole bucket ({why})")
                    spec = dataclasses.replace(spec, attend_prefix=False)
                else:  # one prompt per prefill call
                    print(f"{name}: prefills one prompt per call ({why})")
                    spec = dataclasses.replace(spec, prefill_batch=1)
                    inputs = _one_prompt(inputs)
                program = torch.export.export(module, inputs, strict=False)
        options = per_graph[graph]
        with pdl.launches(options) as launched, tuning.clean_timings(self.device):
            aoti_compile_and_package(
                program, package_path=str(path), inductor_configs=dict(options)
            )
        seconds = round(time.monotonic() - start, 2)
        pdl_note = f", {len(launched)} kernels launched with PDL" if launched else ""
        print(f"{name}: exported and compiled in {seconds}s{pdl_note}", flush=True)
        check_loads(path)
        return spec, seconds

    def _graphs(self, spec: GraphSpec, k_cache: Any, v_cache: Any):
        """(file, graph class, example inputs, dynamic shapes) of every package of a bucket."""
        import torch

        from pipeline.compile.decoder import Decode, Prefill

        b, s, dev = spec.batch, spec.seq, self.device
        # Prefill takes 1..B prompts at once: a dynamic size, traced with 2 (export
        # specialises an example of 1), or 1 where the bucket has one row.
        p = min(2, b)
        prompts = {0: torch.export.Dim("prompts", min=1, max=b)} if b > 1 else None
        rows = torch.arange(p, dtype=torch.long, device=dev)
        for n in spec.prefill_lengths:
            tokens = torch.zeros((p, n), dtype=torch.long, device=dev)
            lengths = torch.full((p,), n, dtype=torch.long, device=dev)
            inputs = (tokens, lengths, rows, k_cache, v_cache)
            yield prefill_file(n, s), Prefill, inputs, (prompts, prompts, prompts, None, None)
        # Decode reads only the first len(key_positions) cache positions, a dynamic size
        # (at least 2: export specialises sizes 0 and 1).
        keys = torch.arange(s, device=dev)
        attended = {0: torch.export.Dim("attended", min=2, max=s)} if s > 2 else None
        tokens = torch.zeros((b, 1), dtype=torch.long, device=dev)
        zeros = torch.zeros((b,), dtype=torch.long, device=dev)
        inputs = (tokens, zeros, k_cache, v_cache, keys)
        yield DECODE_FILE, Decode, inputs, (None, None, None, None, attended)
        # Mixed: decode's step inputs, then 1..B-1 prompts (the rows the step leaves free)
        # packed into a stream of any length up to the longest mixed length, after decode
        # and prefill so that it takes the sizes they could make dynamic
        if not spec.mixed_lengths:
            return
        from pipeline.compile.decoder import Mixed

        p = min(2, b - 1)
        few = {0: torch.export.Dim("prompts", min=1, max=b - 1)} if b > 2 else None
        rows = torch.arange(b - p, b, dtype=torch.long, device=dev)  # free rows: the last
        longest = max(spec.mixed_lengths)
        # traced (and tuned, where sizes are dynamic) at a typical call: a few short prompts
        t = min(longest, MIXED_TRACED)
        stream = {0: torch.export.Dim("packed", min=2, max=longest)} if longest > 2 else None
        prompt = torch.zeros((t,), dtype=torch.long, device=dev)
        lengths = torch.full((p,), t // p, dtype=torch.long, device=dev)
        inputs = (tokens, zeros, prompt, lengths, rows, k_cache, v_cache, keys)
        dims = (None, None, stream, few, few, None, None, attended)
        yield MIXED_FILE, Mixed, inputs, dims


class CpuBackend(AotiBackend):
    name = "cpu"
    device = "cpu"

    def default_options(self) -> dict[str, Any]:
        x86 = X86_OPTIONS if platform.machine() in ("x86_64", "AMD64") else {}
        return {**BASE_OPTIONS, **CPU_OPTIONS, **x86}


class CudaBackend(AotiBackend):
    name = "cuda"
    device = "cuda"

    def default_options(self) -> dict[str, Any]:
        return {**BASE_OPTIONS, **CUDA_OPTIONS}

    def prefill_overrides(self) -> dict[str, Any]:
        return dict(CUDA_PREFILL_OPTIONS)

    def key_options(
        self, flags: tuple[str, ...] | list[str], instance_type: str | None = None
    ) -> dict[str, Any]:
        # Kernels are built and tuned for the GPU that compiles them.
        return {**super().key_options(flags), "gpu": gpu_compute_capability()}

    def unavailable_reason(self) -> str | None:
        if not cuda_present():
            return "no NVIDIA GPU visible (torch.cuda.is_available() is False)"
        return None


def cuda_present() -> bool:
    """A GPU torch can use; checks for the driver first so CPU machines skip importing torch."""
    if not (shutil.which("nvidia-smi") or Path("/proc/driver/nvidia").exists()):
        return False
    import torch

    return torch.cuda.is_available()


@functools.cache
def gpu_compute_capability() -> str:
    """The compute capability of the GPUs here ("9.0"), asked of nvidia-smi, not torch, so a
    no-op recompile stays fast. "none" without a driver."""
    if shutil.which("nvidia-smi") is None:
        return "none"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    return ",".join(sorted({line.strip() for line in out.stdout.splitlines() if line.strip()}))


@functools.cache
def cxx_identity() -> str:
    """The C++ compiler inductor builds packages with, and its version line.

    Inductor takes ``$CXX`` (else g++) when it is imported; this mirrors that rule without
    importing torch, so a no-op recompile stays fast. A different compiler gives a
    different package: one CUDA image we used sets ``CXX`` to a wrapper whose packages
    crash when loaded, while the system g++ builds working ones."""
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx} (not found)"
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"{path} ({type(e).__name__})"
    return f"{path}: {(out.stdout.splitlines() or [''])[0]}"


def _as_built(spec: GraphSpec, inputs: tuple, dynamic: Any) -> tuple[tuple, Any]:
    """A mixed graph's example inputs and dynamic sizes cut to what the bucket's other graphs
    were built with: one prompt a call where prefill could take only one, the whole bucket
    attended where decode could not attend a prefix."""
    tokens, positions, prompt, lengths, slots, k, v, keys = inputs
    dims = list(dynamic)
    if spec.prefill_batch == 1:
        lengths, slots = lengths[:1], slots[:1]
        dims[3] = dims[4] = None
    if not spec.attend_prefix:
        dims[7] = None
    return (tokens, positions, prompt, lengths, slots, k, v, keys), tuple(dims)


def _one_prompt(inputs: tuple) -> tuple:
    """Prefill's example inputs cut to one prompt (tokens, lengths, slots; then the caches)."""
    return (*(t[:1] for t in inputs[:3]), *inputs[3:])


def check_loads(package: Path) -> None:
    """Load a package right after building it: one that cannot load must not be cached.

    A broken build can kill this process (SIGSEGV) rather than raise; the runner then reports
    the signal with this log's last line, which names the package."""
    from torch._inductor import aoti_load_package

    print(f"{package.name}: checking that it loads with {cxx_identity()}", flush=True)
    aoti_load_package(str(package))
    print(f"{package.name}: loads", flush=True)


def constant_specs(module: Any) -> dict[str, dict[str, Any]]:
    """Every constant the graphs bind at load time: name -> dtype and shape (graph.json), so
    a loader can refuse weights of another shape before binding them."""
    return {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for name, t in module.state_dict().items()
    }
