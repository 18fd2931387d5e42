"""Child process entry point:
``python -m pipeline.compile.worker SPEC.json RESULT.json [--parent PID]``.

Each bucket (and the once-per-run ``prepare`` step) compiles in its own process so the
runner can run several at once, enforce a timeout, kill the whole process group on Ctrl-C,
and keep one log per bucket (this process's stdout and stderr). RESULT.json is written,
through a temporary name, only on success.

With ``--parent PID`` (the runner always passes its pid) the worker dies with the runner,
however the runner dies (SIGKILL, OOM kill): the kernel sends it ``PARENT_DEATH_SIGNAL``
(``PR_SET_PDEATHSIG``, Linux), and a thread watching ``getppid()`` backs that up; either
SIGKILLs the worker's process group, so the compilers it started end with it
(``pipeline._procs``).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from pipeline._files import atomic_write_text
from pipeline._procs import die_with_parent
from pipeline.compile.backends import load_backend
from pipeline.compile.backends.base import BucketJob
from pipeline.errors import PipelineError


def run(spec: dict) -> dict:
    backend = load_backend(spec["backend"])
    if spec["kind"] == "prepare":
        out_dir = Path(spec["out_dir"])
        files = backend.prepare(Path(spec["model_dir"]), spec["dtype"], out_dir)
        return {"files": {k: str(v) for k, v in files.items()}, "meta": {}}
    job = BucketJob.from_dict(spec["job"])
    out = backend.compile(job)
    missing = [k for k, p in out.files.items() if not Path(p).is_file()]
    if missing:
        raise PipelineError(
            f"bucket {job.bucket.name}", f"backend reported files it did not write: {missing}"
        )
    return {"files": {k: str(v) for k, v in out.files.items()}, "meta": out.meta}


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[2] == "--parent":
        die_with_parent(int(argv[3]))
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    print(f"[worker] {spec['kind']} {spec.get('name', '')} with {spec['backend']}", flush=True)
    start = time.monotonic()
    try:
        result = run(spec)
    except PipelineError as e:
        traceback.print_exc()
        print(f"error: {e.one_line()}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        traceback.print_exc()
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    result["seconds"] = round(time.monotonic() - start, 3)
    atomic_write_text(result_path, json.dumps(result, indent=2))
    print(f"[worker] done in {result['seconds']}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
