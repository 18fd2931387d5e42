"""The tree's shape (DESIGN.md "Layout"), checked from the code: the import graph has no
cycles, the serving side never imports the compiler, one name means one class, each stage
package has a front door, and modules stay small enough to read."""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict

import pytest

from tests.import_graph import cycles, edges, modules, package_edges, package_of

STAGES = ("contracts", "plan", "compile", "store", "install", "runtime", "server", "parity")
BELOW = {"pipeline.errors", "pipeline._files", "pipeline._front_door"}  # what contracts may use
MAX_LINES = 500


def test_no_module_imports_itself_back_deferred_imports_included():
    assert cycles(edges()) == []


def test_the_packages_import_each_other_one_way():
    assert cycles(package_edges()) == []


@pytest.mark.parametrize("stage", ["install", "runtime", "server"])
def test_the_serving_side_never_imports_the_compiler(stage):
    wrong = sorted(
        (a, b)
        for a, targets in edges().items()
        for b in targets
        if package_of(a) == f"pipeline.{stage}" and package_of(b) == "pipeline.compile"
    )
    assert wrong == []


def test_the_shared_contracts_import_no_stage():
    used = {
        b for a, targets in edges().items() if a.startswith("pipeline.contracts") for b in targets
    }
    assert {package_of(b) for b in used} - {"pipeline.contracts"} <= BELOW


def test_the_stages_reach_shared_nouns_below_them_not_in_each_other():
    packages = package_edges()
    assert "pipeline.store" not in packages["pipeline.plan"]  # store constants: contracts
    assert "pipeline.runtime" not in packages["pipeline.compile"]  # the graph contract
    assert "pipeline.compile" not in packages["pipeline.parity"]  # digests, checkpoint layout
    assert "pipeline.plan" not in packages["pipeline.server"]  # the bucket


def test_no_class_name_is_defined_in_two_modules():
    where: dict[str, list[str]] = defaultdict(list)
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    assert {k: v for k, v in where.items() if len(v) > 1} == {}


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_package_has_a_front_door(stage):
    package = importlib.import_module(f"pipeline.{stage}")
    assert package.__doc__ and package.__doc__.strip().splitlines()[0]
    assert package.__all__, f"pipeline.{stage} lists no entry points"
    for name in package.__all__:
        assert getattr(package, name) is not None


def test_modules_stay_under_the_size_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_the_graph_sees_deferred_and_type_checking_imports():
    graph = edges()
    # deferred into a function (the default loader of serve)
    assert "pipeline.runtime" in graph["pipeline.server.service"]
    # under TYPE_CHECKING
    assert "pipeline.store.refs" in graph["pipeline.store.base"]


def test_cycles_finds_a_loop_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
