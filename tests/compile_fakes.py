"""A cheap compile backend for scheduling, cache and shard tests (no torch, milliseconds).

It runs in the real worker processes, so timeouts, crashes and kills are real. What each
bucket does comes from the environment (inherited by the workers), never from the config,
so behaviours do not change cache keys:

    FAKE_COMPILE        JSON {bucket name: "fail" | "crash" | "hang" | "sleep:SECONDS" |
                        "compiler-hang"}; "compiler-hang" starts a real child "compiler"
                        process (in the worker's process group, as g++ or neuronx-cc would
                        be) that never ends by itself and shrugs off SIGTERM (only SIGKILL
                        ends it), and waits for it
    FAKE_COMPILE_TRACE  a directory; each compile writes <bucket>.json there with its pid
                        (and "compiler": the child's pid), start and end times (end only when
                        it returns); a compiler writes <bucket>.compiler (see COMPILER)
    FAKE_PREPARE        "fail": the once-per-run prepare step raises
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.compile.backends import register, unregister
from pipeline.compile.backends.base import Backend, BucketJob, BucketOutput

NAME = "fake"
# The child "compiler" of "compiler-hang": argv[1] is a file it appends "ready TIME" to once
# its SIGTERM handler is in place and "sigterm TIME" on each SIGTERM (or "-"); argv[2] is a
# marker (the bucket's out dir) that tests look for among live processes.
COMPILER = """
import signal, sys, time
def note(what):
    if sys.argv[1] != "-":
        with open(sys.argv[1], "a") as f:
            f.write(f"{what} {time.time()!r}\\n")
signal.signal(signal.SIGTERM, lambda *_: note("sigterm"))
note("ready")
while True:
    time.sleep(1)
"""


class FakeBackend(Backend):
    name = NAME
    wants_padded_checkpoint = False

    def versions(self) -> dict[str, str]:
        return {"fake-compiler": "1.0"}

    def prepare(self, model_dir: Path, dtype: str, out_dir: Path) -> dict[str, Path]:
        if os.environ.get("FAKE_PREPARE") == "fail":
            raise RuntimeError("fake prepare error")
        path = out_dir / "weights.bin"
        # The checkpoint's bytes go in, so other weights make another file (as in real life).
        digest = hashlib.sha256(
            b"".join(f.read_bytes() for f in sorted(model_dir.glob("*.safetensors")))
        )
        path.write_text(f"weights {digest.hexdigest()[:16]} of {model_dir.name} in {dtype}\n")
        return {"weights.bin": path}

    def compile(self, job: BucketJob) -> BucketOutput:
        name = job.bucket.name
        behaviour = json.loads(os.environ.get("FAKE_COMPILE", "{}")).get(name, "ok")
        trace = os.environ.get("FAKE_COMPILE_TRACE")
        record = {"pid": os.getpid(), "start": time.time()}
        if trace:
            Path(trace, f"{name}.json").write_text(json.dumps(record))
        print(f"fake compile {name}: {behaviour}", flush=True)
        if behaviour == "fail":
            raise RuntimeError(f"fake compiler error in {name}")
        if behaviour == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if behaviour == "hang":
            time.sleep(3600)
        if behaviour == "compiler-hang":
            notes = str(Path(trace, f"{name}.compiler")) if trace else "-"
            compiler = subprocess.Popen(
                [sys.executable, "-c", COMPILER, notes, str(job.out_dir)],
                stdin=subprocess.DEVNULL,
            )
            record["compiler"] = compiler.pid
            if trace:
                Path(trace, f"{name}.json").write_text(json.dumps(record))
            compiler.wait()
        if behaviour.startswith("sleep:"):
            time.sleep(float(behaviour.split(":", 1)[1]))
        graph = job.out_dir / "graph.bin"
        graph.write_text(f"{name} {job.dtype} tp{job.tp} {' '.join(job.flags)}\n")
        if trace:
            Path(trace, f"{name}.json").write_text(json.dumps({**record, "end": time.time()}))
        # Like the cpu/cuda packages: no weights (prepare's weights.bin is cached apart).
        return BucketOutput(files={"graph.bin": graph}, meta={"fake": 1})


def install() -> None:
    register(NAME, FakeBackend)


def uninstall() -> None:
    unregister(NAME)
