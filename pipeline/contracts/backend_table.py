"""Every backend in one table: what compiles for it, what serves it, what checks its parity.

Adding a backend is one entry here plus its modules: config validation, ``auto``, the
compile runner, the runtime and parity all read this table. Entries are import paths
(``"module:attr"``), so reading the table imports neither torch nor the Neuron SDK.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Any

from pipeline.errors import InputError, RuntimeMismatchError


@dataclass(frozen=True)
class BackendSpec:
    name: str
    compiler: str  # a pipeline.compile.backends.base.Backend subclass
    runtime: str | None = None  # a pipeline.runtime.runners.Runner factory; None: not servable
    parity: str | None = None  # a pipeline.parity runner class; None: no parity check
    # a grid without mixed_lengths gets a mixed graph (a step and prompts in one call)
    # whose packed prompts run to this many tokens (0: none; contracts.bucket.mixed_lengths)
    mixed_longest: int = 0


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            "neuron",
            compiler="pipeline.compile.backends.neuron:NeuronBackend",
            runtime="pipeline.runtime.neuron:NeuronRunner",
            parity="pipeline.parity.targets:NeuronTarget",
        ),
        BackendSpec(
            "cuda",
            compiler="pipeline.compile.backends.aoti:CudaBackend",
            runtime="pipeline.runtime.aoti:AotiRunner",
            parity="pipeline.parity.targets:AotiTarget",
            # a short prompt's prefill call costs about a step on a GPU (a pass over the
            # weights), so folding it into the step saves most of that (bench/RESULTS.md,
            # eighteenth round); past a few hundred positions a call is compute, which
            # folding does not shrink, and a long call stalls every running row
            mixed_longest=512,
        ),
        BackendSpec(
            "cpu",
            compiler="pipeline.compile.backends.aoti:CpuBackend",
            runtime="pipeline.runtime.aoti:AotiRunner",
            parity="pipeline.parity.targets:AotiTarget",
        ),
    )
}
# What `auto` tries, in order: the product's target first, the fallbacks after; cpu always works.
AUTO_ORDER = ("neuron", "cuda", "cpu")


def names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise InputError(f"backend '{name}'", "unknown", f"use one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]


def mixed_longest(name: str) -> int:
    """The longest packed stream backend ``name``'s mixed calls take where the grid names no
    mixed lengths (0: no mixed graph, also for a backend not in the table)."""
    entry = BACKENDS.get(name)
    return entry.mixed_longest if entry else 0


def register(name: str, compiler: str, **paths: str | None) -> None:
    """Add or replace a backend (tests register fakes)."""
    old = BACKENDS.get(name)
    BACKENDS[name] = (
        replace(old, compiler=compiler, **paths) if old else BackendSpec(name, compiler, **paths)
    )


def unregister(name: str) -> None:
    BACKENDS.pop(name, None)


def role(name: str, role: str, what: str) -> Any:
    """The ``role`` ("runtime" or "parity") of backend ``name``, imported; one line (exit 2)
    naming ``what`` and the backends that have it when ``name`` has none."""
    entry = BACKENDS.get(name)
    path = getattr(entry, role) if entry else None
    if path is None:
        having = [n for n, s in BACKENDS.items() if getattr(s, role)]
        raise RuntimeMismatchError(
            what,
            f"was compiled for '{name}', which this inf2-pipeline has no {role} runner for",
            f"{role} runners exist for: {', '.join(having)}",
        )
    return load(path)


def load(path: str) -> Any:
    """``"module:attr"`` → the attribute."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "BackendSpec",
    "load",
    "mixed_longest",
    "names",
    "register",
    "role",
    "spec",
]
