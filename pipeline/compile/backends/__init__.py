"""Compile backends by name, from the one backend table (``pipeline.contracts.backend_table``).

A worker process rebuilds any backend from its import path (tests register their own).
"""

from __future__ import annotations

from pipeline.compile.backends.base import Backend, BucketJob, BucketOutput
from pipeline.contracts import backend_table as table
from pipeline.contracts.backend_table import AUTO_ORDER
from pipeline.errors import BackendUnavailableError

_instances: dict[str, Backend] = {}


def register(name: str, target: str | type[Backend]) -> None:
    """Add a compile backend: ``"module:Class"`` or the class itself (importable by name)."""
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    table.register(name, target)
    _instances.pop(name, None)


def unregister(name: str) -> None:
    table.unregister(name)
    _instances.pop(name, None)


def get_backend(name: str) -> Backend:
    if name not in _instances:
        _instances[name] = load_backend(table.spec(name).compiler)
    return _instances[name]


def load_backend(path: str) -> Backend:
    """Instantiate ``"module:Class"``."""
    return table.load(path)()


def backend_path(name: str) -> str:
    return table.spec(name).compiler


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
    "Backend",
    "BucketJob",
    "BucketOutput",
    "get_backend",
    "register",
    "resolve_backend",
]
