"""The package layout is the architecture: imports point down the layers below, never up, and form no cycle.

Every ``import`` / ``from ... import`` of lowprec (its catalog lowprec.recipes too) and lowprec_lab is read with
``ast`` (imports inside functions count too; only ``if TYPE_CHECKING:`` blocks, which never run, are skipped), each
module is placed in the first layer whose prefix it has (the longest prefix wins), and a module may import from its
own layer or any layer below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lowprec", "lowprec_lab")

#: Bottom to top. Within a layer, modules may import each other (without a cycle).
LAYERS: list[tuple[str, ...]] = [
    ("lowprec.errors",),
    # The recipe: a pure value (the standard library, torch dtypes, lowprec.errors; test_lowprec_cycles.py).
    ("lowprec.recipe",),
    ("lowprec.numerics", "lowprec.kernels", "lowprec.model", "lowprec.data", "lowprec.storage"),
    # Mechanisms: FP8 linear (it reads the recipe's FP8 groups as they are, and no other part of a recipe), optimizer
    # components, measurement, collectives.
    ("lowprec.float8", "lowprec.optim", "lowprec.measure", "lowprec.parallel"),
    # One object per FP8 backend / optimizer implementation, built on the mechanisms above; the recipe checks
    # that need one (lowprec.backends.check).
    ("lowprec.backends",),
    # Turning a recipe into mechanism, and predicting it.
    ("lowprec.convert", "lowprec.build_optim", "lowprec.build_parallel", "lowprec.estimate"),
    ("lowprec.train",),
    ("lowprec.recipes",),
    # lowprec's __init__ (the library's front door, its names imported on first use) re-exports the catalog's
    # get_recipe, so it sits above recipes; no module below it imports the package itself.
    ("lowprec",),
    # The lab's wings, bottom to top, as the code needs them: statistics over arrays; the config schema and
    # preflight; the store (tracker, spool, runs read back); the report built from the store; the studies, which
    # use the report's verdict table and plots and run as its ``after`` hook; the commands that drive them.
    ("lowprec_lab.stats",),
    ("lowprec_lab.plan",),
    # Start-up after the door and before the first run (process group, data rank 0 first, corpus tags).
    ("lowprec_lab.runtime",),
    ("lowprec_lab.tracking",),
    ("lowprec_lab.report",),
    ("lowprec_lab.studies",),
    ("lowprec_lab.runner", "lowprec_lab.sizing", "lowprec_lab.selfcheck", "lowprec_lab.commands"),
    # lowprec_lab/__init__, cli.py and __main__.py: the door.
    ("lowprec_lab",),
]

#: The folders of ``lowprec_lab/``; every other module of it (cli, __main__) is the top.
WINGS = ("plan", "runtime", "runner", "tracking", "report", "studies", "stats", "sizing", "selfcheck", "commands")


def _layer(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            for a in node.names:  # `from pkg import submodule` imports the submodule
                out.add(f"{name}.{a.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in out if m.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # keep only imports that name a module of ours (drop `from pkg import function`)
        graph[name] = {m for m in _imports(path, name) if m in modules and m != name}
    return graph


def test_no_import_from_a_higher_layer():
    bad = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in sorted(_graph().items())
        for d in sorted(deps)
        if _layer(d) > _layer(m) and not m.startswith(d + ".")
    ]  # a package's own __init__ is fine
    assert not bad, "imports pointing up the layers:\n" + "\n".join(bad)


def test_no_import_cycle():
    graph = _graph()
    # A package importing its own submodules (its __init__) is not a cycle of modules.
    edges = {
        m: {d for d in deps if not d.startswith(m + ".") and not m.startswith(d + ".")} for m, deps in graph.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _wing(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "lowprec_lab":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else "lowprec_lab"


def _wing_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle of the wing graph (one wing importing another, by any module, top level or inside a
    function), each as ``[a, b, ..., a]`` starting from its smallest wing."""
    edges: dict[str, set[str]] = {}
    for m, deps in graph.items():
        for d in deps:
            a, b = _wing(m), _wing(d)
            if a and b and a != b:
                edges.setdefault(a, set()).add(b)
    cycles: list[list[str]] = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                cycles.append([*path, start])
            elif nxt > start and nxt not in path:  # each cycle once, from its smallest wing
                walk(start, nxt, [*path, nxt])

    for w in sorted(edges):
        walk(w, w, [w])
    return cycles


def test_no_cycle_among_the_lab_wings():
    # Package level: report -> studies -> report was such a cycle (module by module there was none, a function-level
    # import hid it), so the wings are compared as wholes and imports inside functions count.
    graph = _graph()
    assert {_wing(m) for m in graph if m.startswith("lowprec_lab.")} - {"lowprec_lab"} == set(WINGS)
    cycles = _wing_cycles(graph)
    assert not cycles, "cycles among the lowprec_lab wings:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_wing_cycle_count_sees_a_function_level_import(tmp_path):
    """The counter itself: a study module that imports the runner inside a function closes studies -> runner ->
    studies (the runner imports the studies); the count must find it."""
    study = tmp_path / "nvfp4.py"
    study.write_text("def late():\n    from lowprec_lab.runner.ablate import ablate\n\n    return ablate\n")
    graph = {m: set(d) for m, d in _graph().items()}
    graph["lowprec_lab.studies.nvfp4"] = {
        d for d in _imports(study, "lowprec_lab.studies.nvfp4") if d in graph and d != "lowprec_lab.studies.nvfp4"
    }
    assert ["runner", "studies", "runner"] in _wing_cycles(graph)


def test_the_layer_table_covers_every_module():
    for m in _graph():
        _layer(m)
