"""The recipe is a pure value and ``lowprec`` has no package-level import cycle.

Package level: each module counts as its package one below ``lowprec`` (``lowprec.backends.registry`` is
``lowprec.backends``, ``lowprec.recipe`` itself), with every import read by ``test_import_layers._graph`` (top-level
and function-level alike; only ``if TYPE_CHECKING:`` blocks are skipped). Module-level cycles are
``test_import_layers.test_no_import_cycle``'s; a package cycle can hide between modules that form none (there were
some: ``lowprec.backends.fp8_lowprec -> lowprec.parallel.fp8_all_gather`` and ``lowprec.parallel.apply ->
lowprec.backends``, four such cycles in all).
"""

from __future__ import annotations

import json
import subprocess
import sys

from test_import_layers import ROOT, _graph

#: What ``import lowprec.recipe`` may load of lowprec: the package itself (its ``__init__`` runs on any import of a
#: submodule, and installs ``_quiet``'s log filters), the exception types every layer shares (stdlib only), and the
#: recipe.
RECIPE_MAY_LOAD = {"lowprec", "lowprec._quiet", "lowprec.errors", "lowprec.recipe"}


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_graph(prefix: str = "lowprec") -> dict[str, dict[str, tuple[str, str]]]:
    """``{package: {imported package: (a module edge that witnesses it)}}`` for the packages under ``prefix``."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for m, deps in sorted(_graph().items()):
        if _package(m).split(".")[0] != prefix:
            continue
        for d in sorted(deps):
            a, b = _package(m), _package(d)
            if b.split(".")[0] == prefix and a != b and a != prefix and b != prefix:
                out.setdefault(a, {}).setdefault(b, (m, d))
    return out


def elementary_cycles(graph: dict[str, dict[str, tuple[str, str]]]) -> list[list[str]]:
    """Every elementary cycle of ``graph`` once, each starting at its smallest node (a dozen packages: plain DFS)."""
    cycles = []
    for start in sorted(graph):

        def walk(node: str, path: list[str]) -> None:
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    cycles.append([*path, start])
                elif nxt > start and nxt not in path:
                    walk(nxt, [*path, nxt])

        walk(start, [start])
    return cycles


def test_lowprec_has_no_package_cycle():
    graph = package_graph()
    cycles = elementary_cycles(graph)

    def show(c: list[str]) -> str:
        return " -> ".join(c) + "  (" + "; ".join("{} -> {}".format(*graph[a][b]) for a, b in zip(c, c[1:])) + ")"

    assert not cycles, f"{len(cycles)} package-level import cycles in lowprec:\n" + "\n".join(map(show, cycles))


def test_the_cycle_counter_counts():
    # the counter above must see a cycle when there is one: two, a three-package one, and none
    g = {"a": {"b": ("a", "b")}, "b": {"a": ("b", "a"), "c": ("b", "c")}, "c": {"a": ("c", "a")}, "d": {}}
    assert elementary_cycles(g) == [["a", "b", "a"], ["a", "b", "c", "a"]]


def test_import_lowprec_recipe_loads_nothing_else_of_lowprec():
    # a fresh interpreter, so no module another test imported counts; cwd=ROOT puts this checkout first on the path
    code = (
        "import json, sys, lowprec.recipe; print(json.dumps([m for m in sys.modules if m.split('.')[0] == 'lowprec']))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out.splitlines()[-1]))
    assert loaded <= RECIPE_MAY_LOAD, f"import lowprec.recipe also loads {sorted(loaded - RECIPE_MAY_LOAD)}"
    assert "lowprec.recipe" in loaded
