"""The side environment with optimum-neuron 0.4.5 (``make neuron-venv``; ``make test`` builds
it): its interpreter runs tests/upstream/probe.py, which asks upstream's own code (parser,
decoder registry, class signatures, get_neuron_config) what the pipeline must agree with.

INF2_NEURON_VENV names the environment (default: the repository's .neuron-venv). A missing
environment fails the tests that need it, with the command that builds it: CI must run them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "upstream" / "probe.py"
TIMEOUT_S = 600  # imports take ~20 s on a loaded 2-core machine


def side_python() -> Path:
    root = Path(os.environ.get("INF2_NEURON_VENV") or REPO / ".neuron-venv")
    python = root / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"no optimum-neuron side environment at {root} (build it with `make neuron-venv`, "
            "or run the suite with `make test`, which builds it; INF2_NEURON_VENV=DIR points "
            "at another one)",
            pytrace=False,
        )
    return python


def run_probe(request: dict[str, Any]) -> dict[str, Any]:
    """One run of the probe in the side environment (never with this repository on its path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [str(side_python()), str(PROBE)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        cwd=PROBE.parent,
    )
    if done.returncode != 0:
        pytest.fail(f"upstream probe failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
