"""A stage package's front door: ``__all__`` lists its entry points, and each is imported
from the module that defines it on first use (PEP 562), so importing one module of a stage
never imports the rest (``import pipeline.install.installed`` in the server must not load the
pull, and ``pull --help`` stays the init container's lean cold path)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def front_door(package: str, entry_points: dict[str, str]) -> tuple[list[str], Callable]:
    """(``__all__``, the module's ``__getattr__``) for ``package``, whose ``entry_points``
    map each public name to the submodule that defines it."""

    def __getattr__(name: str) -> Any:
        module = entry_points.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return sorted(entry_points), __getattr__
