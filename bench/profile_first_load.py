"""Where a process's first AOTInductor package load goes (issue 29: a GPU server's start).

On the H100 host the first package a server's process loaded took 36–45 s and every later
one 0.0–0.1 s (bench/RESULTS.md, twenty-fifth round), with the driver already up. This
times, in one fresh process, each step up to and past that first load: importing torch,
the first CUDA context, importing ``torch._inductor``, the first and a second package
load (each with its weights bound, as the server binds them), and profiles the first load.
Last, it times in a fresh interpreter what the loads now skip
(``pipeline.runtime.graph_loading._no_isa_probe``): torch's device information, a probe of
the host's CPU vector ISAs, the cause found on the 2-core VM. It also counts what a first
load could be scanning that grows from process to process (the temporary folder, torch's
and Triton's caches), before and after.

    python bench/profile_first_load.py RELEASE_DIR [--bucket b1_s256] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _count(folder: Path) -> int:
    """Entries under ``folder`` (0 where it is not there)."""
    if not folder.is_dir():
        return 0
    return sum(len(files) + len(dirs) for _, dirs, files in os.walk(folder))


def _folders() -> dict[str, Path]:
    home = Path.home()
    user = os.environ.get("USER", "root")
    return {
        "tmp": Path(tempfile.gettempdir()),
        "inductor_cache": Path(
            os.environ.get(
                "TORCHINDUCTOR_CACHE_DIR", f"{tempfile.gettempdir()}/torchinductor_{user}"
            )
        ),
        "triton_cache": Path(os.environ.get("TRITON_CACHE_DIR", home / ".triton" / "cache")),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "release", type=Path, help="a compiled release: its version folder, or the model folder"
    )
    ap.add_argument("--bucket", default=None, help="default: the first bucket")
    ap.add_argument("--top", type=int, default=25, help="profile lines to print")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    before = {name: _count(f) for name, f in _folders().items()}
    steps: dict[str, float] = {}
    t = time.perf_counter()
    import torch

    steps["import torch"] = time.perf_counter() - t
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    if device == "cuda":
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
    steps["first CUDA context"] = time.perf_counter() - t

    from pipeline.contracts.graph_abi import WEIGHTS_FILE, GraphSpec
    from pipeline.install.installed import open_installed
    from pipeline.runtime.graph_loading import load_graph, load_weights

    installed = open_installed(args.release, verify="none")
    bucket = args.bucket or sorted(installed.manifest.buckets)[0]
    bucket_dir = installed.bucket_dir(bucket)
    spec = GraphSpec.read(bucket_dir)
    packages = sorted(bucket_dir.glob("*.pt2"))
    if len(packages) < 2:
        print(f"{bucket_dir}: fewer than two packages to load", file=sys.stderr)
        return 2
    t = time.perf_counter()
    weights = load_weights(bucket_dir / WEIGHTS_FILE, device)
    steps["weights"] = time.perf_counter() - t
    t = time.perf_counter()
    import torch._inductor  # what the first load imports

    steps["import torch._inductor"] = time.perf_counter() - t

    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    load_graph(packages[0], weights, spec, device, single_threaded=True)
    profile.disable()
    steps[f"first load ({packages[0].name})"] = time.perf_counter() - t
    t = time.perf_counter()
    load_graph(packages[1], weights, spec, device, single_threaded=True)
    steps[f"second load ({packages[1].name})"] = time.perf_counter() - t
    # what the loads no longer do (pipeline.runtime.graph_loading._no_isa_probe): torch's
    # check of the host's CPU vector ISAs, timed in a fresh interpreter (no probe cached)
    probe = (
        "import time\n"
        "from torch._inductor import codecache\n"
        "t = time.perf_counter()\n"
        "info = codecache.get_device_information('cpu')\n"
        "print(info['AOTI_CPU_ISA'], time.perf_counter() - t)\n"
    )
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    # the last line is the ISA (one name or several, e.g. "AVX512 AVX512_VNNI" on the H100
    # host, 2026-12-07) and the seconds
    words = ran.stdout.strip().splitlines()[-1].split() if ran.returncode == 0 else []
    isa, seconds = (" ".join(words[:-1]), words[-1]) if len(words) > 1 else ("?", "nan")
    steps[f"device information, skipped by the loads ({isa})"] = float(seconds)
    after = {name: _count(f) for name, f in _folders().items()}

    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    for name, seconds in steps.items():
        print(f"{name:>40}: {seconds:7.2f} s")
    for name in before:
        print(f"{name:>40}: {before[name]} entries before, {after[name]} after")
    print(out.getvalue())
    if args.json:
        report = {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__,
            "bucket": bucket,
            "steps_s": steps,
            "entries_before": before,
            "entries_after": after,
            "profile": out.getvalue(),
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
