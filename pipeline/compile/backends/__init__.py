"""Compile backends by name: a registry behind the small interface in ``base``.

Entries are import paths, so listing or resolving backends imports neither torch nor the
Neuron SDK, and a worker process can rebuild any backend (tests register their own).
"""

from __future__ import annotations

import importlib

from pipeline.compile.backends.base import Backend, BucketJob, BucketOutput
from pipeline.errors import BackendUnavailableError, InputError

REGISTRY: dict[str, str] = {
    "cpu": "pipeline.compile.backends.aoti:CpuBackend",
    "cuda": "pipeline.compile.backends.aoti:CudaBackend",
    "neuron": "pipeline.compile.backends.neuron:NeuronBackend",
}
# What `auto` tries, in order; cpu always works.
AUTO_ORDER = ("neuron", "cuda", "cpu")

_instances: dict[str, Backend] = {}


def register(name: str, target: str | type[Backend]) -> None:
    """Add a backend: ``"module:Class"`` or the class itself (must be importable by name)."""
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    REGISTRY[name] = target
    _instances.pop(name, None)


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)
    _instances.pop(name, None)


def get_backend(name: str) -> Backend:
    if name not in REGISTRY:
        raise InputError(f"backend '{name}'", "unknown", f"use one of: auto, {', '.join(REGISTRY)}")
    if name not in _instances:
        _instances[name] = load_backend(REGISTRY[name])
    return _instances[name]


def load_backend(path: str) -> Backend:
    """Instantiate ``"module:Class"``."""
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)()


def backend_path(name: str) -> str:
    return REGISTRY[name]


def resolve_backend(name: str) -> str:
    """``auto`` → neuron if its SDK is here, else cuda if a GPU is, else cpu. Any other
    name is checked for availability: a missing SDK or GPU is one clear error."""
    if name == "auto":
        return next(n for n in AUTO_ORDER if get_backend(n).unavailable_reason() is None)
    why = get_backend(name).unavailable_reason()
    if why:
        raise BackendUnavailableError(f"backend '{name}'", why)
    return name


__all__ = [
    "REGISTRY",
    "Backend",
    "BucketJob",
    "BucketOutput",
    "get_backend",
    "register",
    "resolve_backend",
]
