"""Dummy modules for the Neuron SDK packages, so optimum-neuron's NxD modeling modules import
on a host without the SDK: enough to read the registry and class signatures; nothing compiles.

Importing this module installs a meta-path finder for the SDK's top-level package names.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUB_ROOTS = (
    "neuronx_distributed",
    "torch_neuronx",
    "neuronxcc",
    "libneuronxla",
    "torch_xla",
    "nki",
    "neuronx_distributed_inference",
)


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub

    def __getitem__(cls, item):
        return _Stub

    def __or__(cls, other):
        return _Stub

    def __ror__(cls, other):
        return _Stub


class _Stub(metaclass=_Meta):
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        # Used as a decorator: hand the decorated function back.
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Stub()

    def __getattr__(self, name):
        return _Stub()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUB_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
