"""CUDA fallback speed: a Llama-3.2-1B-shaped random model (bf16) on one NVIDIA GPU.

    python bench/bench_cuda_decode.py [--out FILE.json] [--workdir DIR] [--flag inductor.K=V]

One run, on a bare GPU box with torch (CUDA), transformers and pydantic installed:

1. writes the model (random weights, seeded; no hub): hidden 2048, 16 layers, 32 query /
   8 KV heads, intermediate 8192, vocab 128256, tied embeddings, llama3 rope: 2.47 GB;
2. compiles it with the project's compile stage (cuda backend: torch.export + AOTInductor)
   as two releases compiled at once: decode buckets b1/b8/b32 × s256 (a 128-token prompt and
   128 new tokens) and a prefill bucket b1 × s2048; publishes and pulls them as a server would;
3. measures, in this one run:
   - the memory-bandwidth floor: weight bytes ÷ the device-to-device copy bandwidth of a
     4 GiB tensor (CUDA events; a copy reads and writes each byte);
   - decode latency per token after a 128-token prompt at batch 1, 8 and 32, end to end
     through ``BucketedModel.generate`` (CUDA graphs): (t(1 + N new) − t(1 new)) ÷ N, and a
     decode replay alone;
   - Hugging Face eager ``generate`` on the same model and prompt, measured the same way;
   - prefill tokens per second for a 2048-token prompt;
   - parity of both releases against the fp32 eager model on the GPU (``pipeline.parity``);
4. prints the figures and both ratios (vs the floor: target ≤ 2×; vs HF eager: ≥ 20× faster),
   and writes them with the date and the hardware to ``--out`` as JSON.

Compiled buckets stay in ``--workdir`` (the compile cache): a second run compiles nothing
(``--compile-only`` stops after compiling, to split a run in two).
``--model smoke --backend cpu`` runs every step on a tiny model on the CPU (a check of this
script, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python bench/bench_cuda_decode.py` from a plain checkout

TARGET_VS_FLOOR = 1.6  # decode b1 ≤ 1.6× the bandwidth floor
TARGET_VS_HF = 20.0  # decode b1 ≥ 20× faster than HF eager generate
TARGET_VS_PEER = 1.0  # gpt-fast ms ÷ ours ≥ 1 at every batch size
TARGET_LONG_VS_SHORT = 1.10  # decode in a long bucket ≤ 1.1× a short one, same filled length


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    dtype: str


SHAPES = {
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 8192, 128256, "bfloat16"),
    "smoke": Shape(64, 2, 8, 2, 128, 512, "bfloat16"),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- setup ----------------------------------------------------------------------------------


def preflight(backend: str) -> None:
    """Fail in one line, before minutes of work, on what this script cannot run with."""
    missing = []
    for module in ("torch", "transformers", "safetensors", "pydantic", "yaml"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        sys.exit(f"error: missing Python packages: {', '.join(missing)} (pip install them)")
    import inspect

    import torch
    from torch._inductor import aoti_load_package
    from torch._inductor.package.package import AOTICompiledModel

    if backend == "cuda" and not torch.cuda.is_available():
        print("bench_cuda_decode: skipped, no CUDA GPU (run it on an NVIDIA GPU)", file=sys.stderr)
        sys.exit(0)
    load_params = inspect.signature(aoti_load_package).parameters
    needs = {
        "aoti_load_package(run_single_threaded=...)": "run_single_threaded" in load_params,
        "aoti_load_package(device_index=...)": "device_index" in load_params,
        "AOTICompiledModel.load_constants(user_managed=...)": "user_managed"
        in inspect.signature(AOTICompiledModel.load_constants).parameters,
    }
    lacking = [k for k, ok in needs.items() if not ok]
    if lacking:
        sys.exit(f"error: torch {torch.__version__} lacks {', '.join(lacking)} (upgrade torch)")


def default_flags(backend: str) -> list[str]:
    """The wrapper that AOTInductor compiles around the kernels is host code; decode replays
    CUDA graphs, so its speed is off the measured path: build it at -O0 to save minutes."""
    from torch._inductor import config

    if backend == "cuda" and hasattr(config.aot_inductor, "compile_wrapper_opt_level"):
        return ["inductor.aot_inductor.compile_wrapper_opt_level=O0"]
    return []


def llama_config(shape: Shape):
    """A transformers LlamaConfig of ``shape`` with Llama 3.2's rope."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


def write_model(shape: Shape, out: Path, device: str, seed: int = 0) -> Path:
    """A random-weight Llama of ``shape`` (Llama 3.2's rope), saved in ``shape.dtype``."""
    import torch
    import transformers

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    config = llama_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 1.2B parameters is quick on a GPU
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, shape.dtype))
    tmp = out.with_name(out.name + ".incomplete")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run cut short
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)
    return out


def write_config(
    path: Path,
    name: str,
    ckpt: Path,
    dtype: str,
    backend: str,
    batches,
    seqs,
    flags: list[str],
    store: Path,
    prefill_lengths=(),
) -> Path:
    buckets = {"batch_sizes": list(batches), "sequence_lengths": list(seqs)}
    if prefill_lengths:
        buckets["prefill_lengths"] = list(prefill_lengths)
    config = {
        "model": {"name": name, "checkpoint": str(ckpt), "dtype": dtype},
        "target": {"backend": backend, "instance_type": "inf2.xlarge", "tp_degree": 1},
        "buckets": buckets,
        "compiler": {"flags": flags, "auto_cast_type": "bf16", "timeout_s": 1800},
        "store": str(store),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def compile_and_install(configs: list[Path], workdir: Path, jobs: list[int]) -> dict[str, Any]:
    """Compile the releases at once (one thread each; compiles run in worker processes),
    then publish and pull each: the release directories a server would load."""
    from pipeline.compile.release import publish_release
    from pipeline.compile.scheduler import compile_release
    from pipeline.install.pull import pull_release
    from pipeline.plan.config import load_config
    from pipeline.store import open_store

    releases = [load_config(c) for c in configs]
    reports: dict[str, Any] = {}

    def run(release, n: int) -> None:
        try:
            reports[release.name] = compile_release(
                release,
                jobs=n,
                workdir=workdir / "compile" / release.name,
                on_event=lambda kind, r: log(f"{release.name} {r.bucket.name}: {r.status}"),
            )
        except Exception as e:  # reported below, after both threads
            reports[release.name] = e

    start = time.monotonic()
    threads = [
        threading.Thread(target=run, args=(r, n)) for r, n in zip(releases, jobs, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - start
    out: dict[str, Any] = {"wall_seconds": round(seconds, 1), "releases": {}}
    for release in releases:
        report = reports[release.name]
        if isinstance(report, Exception):
            sys.exit(f"error: compiling {release.name}: {type(report).__name__}: {report}")
        if report.failed:
            failed = [(r.bucket.name, r.error, str(r.log)) for r in report.failed]
            sys.exit(f"error: compiling {release.name} failed: {failed}")
        version = publish_release(release).version
        store = open_store(release.store_url)
        pull_release(store, release.name, workdir / "models", version=version)
        out["releases"][release.name] = {
            "dir": str(workdir / "models" / release.name),
            "version": version,
            "buckets": {
                r.bucket.name: {"status": r.status, "seconds": round(r.seconds, 1)}
                for r in report.results
            },
        }
    return out


# --- measurements -----------------------------------------------------------------------------


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def wall(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_wall(fn, device: str, reps: int) -> float:
    return statistics.median(wall(fn, device) for _ in range(reps))


def device_ms(fn, device: str, reps: int) -> float:
    """Mean time of one call: CUDA events around ``reps`` back-to-back calls."""
    import torch

    fn()
    if device != "cuda":
        return median_wall(fn, device, reps) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second moved by a device-to-device copy (each byte read once, written once)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = device_ms(lambda: dst.copy_(src), device, reps=20)
    return 2 * nbytes / (ms / 1e3)


def weight_bytes(release_dir: Path) -> int:
    """Bytes a decode step reads: every weight once (a tied embedding is one tensor)."""
    from safetensors import safe_open

    path = next((release_dir / "current" / "buckets").glob("*/weights.safetensors"))
    total = 0
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            if name != "rope_inv_freq":
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * {"BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
    return total


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def decode_per_token(
    model, batch: int, prompt: int, new: int, vocab: int, device: str, reps: int
) -> dict[str, float]:
    """End to end through generate(): (t(prompt → 1 + new) − t(prompt → 1)) ÷ new."""
    import torch

    ps = prompts(batch, prompt, vocab)
    model.generate(ps, 1 + new, None)  # warm: loads the bucket, records its graph
    long = median_wall(lambda: model.generate(ps, 1 + new, None), device, reps)
    short = median_wall(lambda: model.generate(ps, 1, None), device, reps)
    per_token = (long - short) / new
    bucket = model.select(batch, prompt + new)
    session = model.session(bucket)
    tok = torch.zeros((bucket.batch, 1), dtype=torch.int64, device=device)
    pos = torch.full((bucket.batch,), prompt, dtype=torch.int64, device=device)
    step_ms = device_ms(lambda: session.decode(tok, pos, attended=prompt + 1), device, reps=50)
    return {
        "bucket": bucket.name,
        "ms_per_token": round(per_token * 1e3, 4),
        "tokens_per_s": round(batch / per_token, 1),
        "decode_step_ms": round(step_ms, 4),
        "graphed": session.graphed,
        "prefill_ms": round(short * 1e3, 3),
    }


def prefill_rate(model, length: int, vocab: int, device: str, reps: int) -> dict[str, float]:
    import torch

    bucket = model.select(1, length)
    session = model.session(bucket)
    tokens = torch.tensor(prompts(1, length, vocab, seed=1), device=device)
    tokens = torch.nn.functional.pad(tokens, (0, bucket.seq - length))
    lengths = torch.tensor([length], device=device)
    ms = device_ms(lambda: session.prefill(tokens, lengths), device, reps)
    first_token = median_wall(
        lambda: model.generate(tokens[:, :length].tolist(), 1, None), device, reps
    )
    return {
        "bucket": bucket.name,
        "prompt_tokens": length,
        "prefill_ms": round(ms, 3),
        "tokens_per_s": round(length / (ms / 1e3)),
        "time_to_first_token_ms": round(first_token * 1e3, 3),
    }


def slot_prefills(model, vocab: int, device: str, reps: int) -> dict[str, Any]:
    """What serve pays to admit requests: ``Slots.prefill_many`` of P prompts into the
    largest bucket, host sync included, at each prefill length, recorded as a CUDA graph
    (where the session holds one) against the same packages called one launch at a time."""
    bucket = max(model.buckets, key=lambda b: (b.batch, b.seq))
    slots = model.slots(bucket)
    session = slots.session
    graphs = session.graphs
    out: dict[str, Any] = {"bucket": bucket.name, "calls": {}}
    for t in session.spec.prefill_lengths:
        for p in sorted({1, min(4, slots.prefill_batch)}):
            ps = prompts(p, t, vocab, seed=2)
            rows = list(range(p))

            def graphed(ps=ps, rows=rows) -> None:
                slots.prefill_many(rows, ps)
                for r in rows:
                    slots.free(r)

            def eager(ps=ps, rows=rows) -> None:
                graphs.prefill(rows, ps, session.k_cache, session.v_cache)[1].tolist()

            figures = {}
            for way, fn in (("graph", graphed), ("eager", eager)):
                fn()
                figures[f"{way}_ms"] = round(median_wall(fn, device, reps) * 1e3, 3)
            figures["graphed"] = (p, t) in session.prefill_graphs
            out["calls"][f"p{p}_t{t}"] = figures
            log(f"slot prefill {p}×{t} in {bucket.name}: {figures}")
    return out


def _steps(slots, rows: list[int], n: int) -> None:
    for _ in range(n):
        slots.step(rows)


def _recorded_equals_eager(slots, rows: list[int], vocab: int) -> bool | None:
    """The same seeded rows stepped with the session's recorded sampler and with the eager
    draw (the sampler set aside for the second run): the same tokens, or the recording is
    wrong. None where the session records none (cpu)."""
    from pipeline.runtime.sampling import SamplingParams

    session = slots.session
    recorded = session.sampler
    if recorded is None:
        return None
    runs = []
    try:
        for sampler in (recorded, None):
            session.sampler = sampler
            ps = prompts(len(rows), 8, vocab, seed=4)
            got = [
                slots.prefill(r, p, SamplingParams(0.9, 0.8, top_k=50, seed=r))
                for r, p in zip(rows, ps, strict=True)
            ]
            for _ in range(8):
                got += slots.step(rows)
            for r in rows:
                slots.free(r)
            runs.append(got)
    finally:
        session.sampler = recorded
    return runs[0] == runs[1]


def slot_sampling(model, batches: list[int], vocab: int, device: str, reps: int) -> dict:
    """What sampling costs a decode step: ``Slots.step`` over every slot of each bucket with
    every row greedy, against every row sampled (temperature 0.7, top_p 0.9, its own seed),
    host read included, median of ``reps`` timings of 16 steps each."""
    from pipeline.runtime.sampling import SamplingParams

    out: dict[str, Any] = {}
    for b in batches:
        bucket = min((x for x in model.buckets if x.batch == b), key=lambda x: x.seq)
        slots = model.slots(bucket)
        rows = list(range(b))
        figures = {"bucket": bucket.name}
        for way in ("greedy", "sampled"):
            ps = prompts(b, 8, vocab, seed=3)
            params = [SamplingParams(0.7, 0.9, seed=r) for r in rows] if way == "sampled" else None
            times = []
            for _ in range(reps):
                for r, p in zip(rows, ps, strict=True):
                    slots.prefill(r, p, None if params is None else params[r])
                steps = functools.partial(_steps, slots, rows, 16)
                times.append(wall(steps, device) / 16)
                for r in rows:
                    slots.free(r)
            figures[f"{way}_step_ms"] = round(statistics.median(times) * 1e3, 3)
        figures["sampled_vs_greedy"] = round(
            figures["sampled_step_ms"] / figures["greedy_step_ms"], 3
        )
        figures["recorded_sampler_equals_eager"] = _recorded_equals_eager(slots, rows, vocab)
        out[f"batch{b}"] = figures
        log(f"slot step, greedy vs sampled, {bucket.name}: {figures}")
    return out


def hf_eager_per_token(
    ckpt: Path, dtype: str, prompt: int, new: int, vocab: int, device: str, reps: int
) -> dict[str, float]:
    """Hugging Face eager generate on the same model and prompt, measured the same way."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts(1, prompt, vocab), device=device)
    mask = torch.ones_like(ids)

    def gen(n: int):
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    gen(new + 1)  # warm
    long = median_wall(lambda: gen(new + 1), device, reps)
    short = median_wall(lambda: gen(1), device, reps)
    attn = getattr(model.config, "_attn_implementation", "?")
    return {"ms_per_token": round((long - short) / new * 1e3, 3), "attention": attn}


def parity(release_dir: Path, ckpt: Path, device: str) -> dict[str, Any]:
    from pipeline.parity import check_release

    report = check_release(release_dir, reference=device, checkpoint=ckpt, steps=8)
    print(report.to_markdown(), flush=True)
    return report.to_dict()


def hardware(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpus_visible=torch.cuda.device_count(),
            cuda=torch.version.cuda,
        )
        with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[0]
            )
    return info


# --- the run --------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--workdir", type=Path, default=REPO / "work" / "bench-cuda")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cuda-decode.json")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens for decode")
    p.add_argument("--new-tokens", type=int, default=128, help="decode steps measured")
    p.add_argument("--hf-new-tokens", type=int, default=32, help="decode steps for HF eager")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens for prefill")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument(
        "--flag",
        action="append",
        default=None,
        help="compiler flag, inductor.K=V (repeatable; replaces the default: a -O0 wrapper)",
    )
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-hf", action="store_true", help="skip Hugging Face eager generate")
    p.add_argument(
        "--long-batches", default="1,32", help="batch sizes of the long (prefill) buckets"
    )
    p.add_argument(
        "--peer",
        type=Path,
        default=REPO / "peers" / "gpt-fast",
        help="a copy of ../shared/peers/gpt-fast: run in the same run, when present",
    )
    p.add_argument(
        "--prefill-lengths",
        default="256,1024",
        help="shorter prefill graphs of the long buckets (serve prefills a prompt at the "
        "shortest that holds it; '' for none)",
    )
    p.add_argument(
        "--decode-prefill-lengths",
        default="64,128",
        help="shorter prefill graphs of the decode buckets (the s256 serve replay's prompts "
        "average 68 tokens; '' for none)",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="stop after compiling and installing (a later run then compiles nothing)",
    )
    args = p.parse_args()
    args.workdir = args.workdir.resolve()  # the configs written there name paths beside them
    device = args.backend
    preflight(device)
    flags = default_flags(device) if args.flag is None else args.flag

    import torch
    import transformers

    from pipeline._files import atomic_write_text
    from pipeline.compile.backends.aoti import cxx_identity
    from pipeline.runtime import BucketedModel

    shape = SHAPES[args.model]
    batches = [int(b) for b in args.batches.split(",")]
    long_batches = [int(b) for b in args.long_batches.split(",") if b.strip()]
    decode_seq = args.prompt + args.new_tokens
    result: dict[str, Any] = {
        "bench": "cuda-decode",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware(device),
        "software": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cxx": cxx_identity(),
        },
        "model": {"name": args.model, **asdict(shape)},
        "flags": flags,
    }

    def save() -> None:  # after every stage: a run cut short still leaves its figures
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")

    log(
        f"{result['hardware']} · torch {torch.__version__} · transformers "
        f"{transformers.__version__}"
    )
    bandwidth = copy_bandwidth(device, int(args.copy_gib * 2**30))
    log(f"device copy bandwidth: {bandwidth / 1e9:,.0f} GB/s")

    ckpt = write_model(shape, args.workdir / f"{args.model}-random", device)
    log(f"model: {ckpt}")
    name = f"bench-{args.model}"
    store = args.workdir / "store"
    configs = [
        write_config(
            args.workdir / "decode.yaml",
            f"{name}-decode",
            ckpt,
            shape.dtype,
            device,
            batches,
            [decode_seq],
            flags,
            store / "decode",
            [int(n) for n in args.decode_prefill_lengths.split(",") if n],
        ),
        write_config(
            args.workdir / "prefill.yaml",
            f"{name}-prefill",
            ckpt,
            shape.dtype,
            device,
            long_batches,
            [args.prefill],
            flags,
            store / "prefill",
            [int(n) for n in args.prefill_lengths.split(",") if n],
        ),
    ]
    log(
        f"compiling decode buckets b{{{args.batches}}}_s{decode_seq} and "
        f"b{{{args.long_batches}}}_s{args.prefill} ..."
    )
    jobs = [len(batches), len(long_batches)]
    if not long_batches:  # the decode release alone (serve's s256 replay; decode beside gpt-fast)
        configs, jobs = configs[:1], jobs[:1]
    result["compile"] = compile_and_install(configs, args.workdir, jobs=jobs)
    log(f"compiled and installed in {result['compile']['wall_seconds']} s")
    save()
    if args.compile_only:
        return

    decode_dir = Path(result["compile"]["releases"][f"{name}-decode"]["dir"])
    weights = weight_bytes(decode_dir)
    floor_ms = weights / bandwidth * 1e3
    result["memory"] = {
        "weight_bytes": weights,
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "floor_ms_per_token": round(floor_ms, 4),
    }
    log(f"weights {weights / 1e9:.3f} GB → floor {floor_ms:.3f} ms per decode step")

    if (args.peer / "peer_decode.py").is_file():
        result["peer"] = run_peer(args.peer)
        save()
    else:
        log(f"no gpt-fast peer at {args.peer}: not compared (see ../shared/peers/gpt-fast)")

    model = BucketedModel.load(decode_dir)
    model.warmup()
    result["slot_prefill"] = slot_prefills(model, shape.vocab, device, args.reps * 4)
    result["slot_sampling"] = slot_sampling(model, batches, shape.vocab, device, args.reps)
    save()
    result["decode"] = {}
    for b in batches:
        figures = decode_per_token(
            model, b, args.prompt, args.new_tokens, shape.vocab, device, args.reps
        )
        result["decode"][f"batch{b}"] = figures
        log(f"decode batch {b}: {figures}")
        save()
    del model

    if long_batches:  # the long release's figures (without one: the decode release alone)
        prefill_dir = Path(result["compile"]["releases"][f"{name}-prefill"]["dir"])
        prefill_model = BucketedModel.load(prefill_dir)
        result["prefill"] = prefill_rate(
            prefill_model, args.prefill, shape.vocab, device, args.reps
        )
        log(f"prefill: {result['prefill']}")
        result["decode_in_long_bucket"] = {}
        for b in long_batches:  # the same prompt and new tokens as above, in a 2048 bucket
            figures = decode_per_token(
                prefill_model, b, args.prompt, args.new_tokens, shape.vocab, device, args.reps
            )
            result["decode_in_long_bucket"][f"batch{b}"] = figures
            log(f"decode batch {b} in {figures['bucket']}: {figures}")
        del prefill_model
        save()

    if not args.skip_hf:
        result["hf_eager"] = hf_eager_per_token(
            ckpt,
            shape.dtype,
            args.prompt,
            args.hf_new_tokens,
            shape.vocab,
            device,
            max(2, args.reps // 2),
        )
        log(f"HF eager generate: {result['hf_eager']}")
    result["ratios"] = ratios(result, floor_ms)
    save()

    if not args.skip_parity:
        result["parity"] = {}
        for d in (decode_dir, prefill_dir) if long_batches else (decode_dir,):
            try:
                report = parity(d, ckpt, device)
                keep = ("max_abs", "max_rel", "top1", "top1_near_ties", "greedy_exact", "passed")
                result["parity"][d.name] = {
                    "passed": report["passed"],
                    "tolerance": report["tolerance"],
                    "buckets": {b["bucket"]: {k: b[k] for k in keep} for b in report["buckets"]},
                }
            except Exception as e:  # the speed figures stand on their own
                result["parity"][d.name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"parity of {d.name} did not run: {e}")
        save()

    print_summary(result, floor_ms)
    log(f"JSON: {args.out}")


def run_peer(peer: Path) -> dict[str, Any]:
    """gpt-fast's decode on the same GPU, model shape and prompt (its own script, as its
    README says to run it), before ours: same machine, same run."""
    log(f"gpt-fast peer: {peer}/peer_decode.py ...")
    run = subprocess.run(
        [sys.executable, str(peer / "peer_decode.py")],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if run.returncode != 0:
        log(f"gpt-fast peer failed: {run.stderr.strip().splitlines()[-3:]}")
        return {"error": run.stderr.strip()[-2000:]}
    figures = json.loads(run.stdout)
    log(f"gpt-fast peer: { {k: v for k, v in figures.items() if k.endswith('per_step')} }")
    return figures


def ratios(result: dict[str, Any], floor_ms: float) -> dict[str, Any]:
    """Every ratio the run's goals are judged by, each beside its target."""
    out: dict[str, Any] = {}
    decode = result["decode"]
    ours_b1 = decode.get("batch1", {}).get("ms_per_token", float("nan"))
    out["decode_b1_vs_floor"] = round(ours_b1 / floor_ms, 3)
    out["decode_b1_vs_floor_target"] = TARGET_VS_FLOOR
    out["decode_b1_vs_floor_met"] = ours_b1 / floor_ms <= TARGET_VS_FLOOR
    peer = result.get("peer", {})
    for key, d in decode.items():
        theirs = peer.get(f"b{key.removeprefix('batch')}_ms_per_step")
        if theirs:  # > 1: gpt-fast takes longer per step than we do
            out[f"gpt_fast_vs_ours_{key}"] = round(theirs / d["ms_per_token"], 3)
            out[f"gpt_fast_vs_ours_{key}_met"] = theirs / d["ms_per_token"] >= TARGET_VS_PEER
    for key, d in result.get("decode_in_long_bucket", {}).items():
        if key in decode:
            r = d["ms_per_token"] / decode[key]["ms_per_token"]
            out[f"long_vs_short_bucket_{key}"] = round(r, 3)
            out[f"long_vs_short_bucket_{key}_met"] = r <= TARGET_LONG_VS_SHORT
    if "hf_eager" in result:
        hf = result["hf_eager"]["ms_per_token"]
        out["speedup_vs_hf_eager"] = round(hf / ours_b1, 2)
        out["speedup_vs_hf_eager_met"] = hf / ours_b1 >= TARGET_VS_HF
    return out


def print_summary(result: dict[str, Any], floor_ms: float) -> None:
    r = result["ratios"]
    print()
    print(
        f"== CUDA fallback, {result['model']['name']} ({result['model']['dtype']}) on "
        f"{result['hardware'].get('gpu', result['hardware']['cpu'])}, {result['date']}"
    )
    print(f"copy bandwidth      {result['memory']['copy_bandwidth_GBps']:>10,.0f} GB/s")
    print(
        f"bandwidth floor     {floor_ms:>10.3f} ms/token  "
        f"({result['memory']['weight_bytes'] / 1e9:.2f} GB of weights)"
    )
    peer = result.get("peer", {})
    for section in ("decode", "decode_in_long_bucket"):
        for key, d in result.get(section, {}).items():
            theirs = peer.get(f"b{key.removeprefix('batch')}_ms_per_step")
            vs = f"  gpt-fast {theirs:.3f} ms" if theirs and section == "decode" else ""
            where = "decode" if section == "decode" else "long  "
            print(
                f"{where} {key:<8}     {d['ms_per_token']:>10.3f} ms/token  "
                f"{d['tokens_per_s']:>10,.0f} tokens/s  (replay {d['decode_step_ms']:.3f} ms, "
                f"{d['bucket']}){vs}"
            )
    for key, d in result.get("slot_prefill", {}).get("calls", {}).items():
        print(
            f"slot prefill {key:<10} {d['graph_ms']:>8.3f} ms graphed  {d['eager_ms']:>8.3f} ms "
            f"one launch at a time  ({result['slot_prefill']['bucket']})"
        )
    for key, d in result.get("slot_sampling", {}).items():
        print(
            f"slot step {key:<8} {d['greedy_step_ms']:>8.3f} ms greedy  "
            f"{d['sampled_step_ms']:>8.3f} ms sampled (T 0.7, top_p 0.9)  "
            f"{d['sampled_vs_greedy']:.3f}×  ({d['bucket']}; recorded sampler's tokens = "
            f"eager draw's: {d.get('recorded_sampler_equals_eager')})"
        )
    if (p := result.get("prefill")) is not None:
        print(
            f"prefill {p['prompt_tokens']} tokens {p['prefill_ms']:>8.2f} ms        "
            f"{p['tokens_per_s']:>10,} tokens/s"
        )
    met = {True: "met", False: "NOT met"}
    targets = {
        "decode_b1_vs_floor": ("≤", TARGET_VS_FLOOR),
        "gpt_fast_vs_ours": ("≥", TARGET_VS_PEER),
        "long_vs_short_bucket": ("≤", TARGET_LONG_VS_SHORT),
        "speedup_vs_hf_eager": ("≥", TARGET_VS_HF),
    }
    for key, value in r.items():
        if key.endswith(("_met", "_target")):
            continue
        op, target = next(t for prefix, t in targets.items() if key.startswith(prefix))
        print(f"{key:<34} {value:>8.3f}×  (target {op} {target:g}×: {met[r[key + '_met']]})")
    for name, rep in result.get("parity", {}).items():
        print(f"parity {name}: {'PASS' if rep.get('passed') else 'FAIL ' + str(rep)}")


if __name__ == "__main__":
    main()
