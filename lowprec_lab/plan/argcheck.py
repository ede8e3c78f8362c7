"""The key tree of ``lowprec train`` / ``lowprec ablate`` read from the config dataclasses' source, and the
refusals that need nothing more than it, made before Hydra, torch or MLflow is imported.

A bad key or name used to cost 10-30 s of imports before Hydra refused it in its own words (``Key 'step' not in
'TrainNode'``, ``Could not find 'model/x'``). ``schema`` reads the fields of ``TrainConfig`` / ``AblateConfig``
(lowprec_lab/plan/config.py) and of every dataclass they nest with ``ast``, following the modules' imports, so the
tree is that of the code on disk with no copy to keep in step. The catalog's recipe names, the model sizes, the
data sources, the launchers and the experiment files are read the same way. Whatever cannot be read (a shape of
source this module does not know) is left to Hydra: ``precheck`` only refuses what it is sure of.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import re
from pathlib import Path

from lowprec.errors import ConfigError

#: Nodes whose keys depend on a choice made elsewhere (the model size, the recipe, a study, the ablation's recipes)
#: or are Hydra's: not checked here (Hydra, ``typed``, preflight and the studies check them after composition).
OPEN = frozenset({"model", "recipe", "study", "grid", "seeds", "hydra"})
#: ``Any``-typed fields of the root schemas whose node is one dataclass (every ``data/<source>`` is a ``DataSpec``).
ANY_AS = {"data": "DataSpec"}
CONFIG_MODULE = "lowprec_lab.plan.config"
ROOTS = {"train": "TrainConfig", "ablate": "AblateConfig"}
#: a plain option name (``fp8_rowwise``, ``125m``, ``llama3_8b``); anything else (an interpolation, quotes) is Hydra's
_NAME = re.compile(r"[\w.-]+")


class UnknownNameError(ConfigError):
    """A key, recipe, model, experiment or other option that does not exist; the message says which and the
    nearest names."""


def _module_file(module: str) -> Path | None:
    """The source file of ``module`` without importing it (only the top-level package's location is looked up)."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations)))
    path = base.joinpath(*rest.split(".")) if rest else base
    for f in (path.with_suffix(".py"), path / "__init__.py"):
        if f.is_file():
            return f
    return None


@functools.cache
def _tree(module: str) -> ast.Module | None:
    f = _module_file(module)
    return ast.parse(f.read_text(encoding="utf-8")) if f else None


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    is_pkg = (_module_file(module) or Path()).name == "__init__.py"
    base = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _find(module: str, name: str, depth: int = 0) -> tuple[str, ast.stmt] | None:
    """The statement of ``module`` that defines ``name`` (a class or an assignment), following ``from X import
    name`` re-exports; None when not found."""
    tree = _tree(module)
    if tree is None or depth > 8:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return module, node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return module, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _find(_absolute(module, node), alias.name, depth + 1)
    return None


def _is_dataclass(node: ast.ClassDef) -> bool:
    def name(d):
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")

    return any(name(d) == "dataclass" for d in node.decorator_list)


def _fields(module: str, cls: ast.ClassDef) -> dict[str, tuple[str, ast.expr]]:
    """``field -> (module, annotation)`` of a dataclass, its bases' first (a subclass's field overrides)."""
    out: dict[str, tuple[str, ast.expr]] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name):
            found = _find(module, base.id)
            if found and isinstance(found[1], ast.ClassDef):
                out.update(_fields(found[0], found[1]))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if "ClassVar" not in ast.unparse(node.annotation):
                out[node.target.id] = (module, node.annotation)
    return out


def _subtree(module: str, annotation: ast.expr, key: str | None = None):
    """A field's node: a dict of its fields for a dataclass, ``None`` for an open node, ``True`` for a leaf.
    ``key``: the field's name at the root (``OPEN`` and ``ANY_AS`` apply there only)."""
    if key in OPEN:
        return None
    name = ANY_AS.get(key) if key in ANY_AS else annotation.id if isinstance(annotation, ast.Name) else None
    found = _find(module, name) if name else None
    if found and isinstance(found[1], ast.ClassDef) and _is_dataclass(found[1]):
        return {k: _subtree(m, a) for k, (m, a) in _fields(*found).items()}
    return True


@functools.cache
def schema(command: str) -> dict | None:
    """The key tree of ``command`` (``train`` | ``ablate``): ``{key: subtree}``, a subtree being a dict (a
    dataclass node), ``True`` (a leaf) or ``None`` (an open node: ``model``, ``recipe``, ``study``, ``hydra``).
    None when the schema's source cannot be read (nothing is then checked before Hydra)."""
    found = _find(CONFIG_MODULE, ROOTS[command])
    if not found or not isinstance(found[1], ast.ClassDef):
        return None
    tree = {k: _subtree(m, a, k) for k, (m, a) in _fields(*found).items()}
    tree.setdefault("hydra", None)
    return tree


def _literal_keys(module: str, name: str, depth: int = 0) -> list[str] | None:
    """The keys of the dict ``name`` of ``module``: string keys of a dict literal (``**OTHER`` unpacked), or the
    keys of a dict comprehension over a literal tuple/list of strings (``{n: f(n) for n in NAMES}``)."""
    found = _find(module, name)
    if not found or depth > 4 or not isinstance(found[1], ast.Assign | ast.AnnAssign):
        return None
    mod, node = found
    value = node.value
    if isinstance(value, ast.Dict):
        out: list[str] = []
        for k, v in zip(value.keys, value.values, strict=True):
            if k is None and isinstance(v, ast.Name):
                more = _literal_keys(mod, v.id, depth + 1)
                if more is None:
                    return None
                out += more
            elif isinstance(k, ast.Constant) and isinstance(k.value, str):
                out.append(k.value)
            else:
                return None
        return out
    if isinstance(value, ast.DictComp) and len(value.generators) == 1:
        it = value.generators[0].iter
        if isinstance(it, ast.Name):
            return _literal_list(mod, it.id)
    if isinstance(value, ast.List | ast.Tuple):
        return _literal_list(mod, name)
    return None


def _literal_list(module: str, name: str) -> list[str] | None:
    found = _find(module, name)
    if not found or not isinstance(found[1], ast.Assign | ast.AnnAssign):
        return None
    value = found[1].value
    if isinstance(value, ast.List | ast.Tuple):
        items = [e.value if isinstance(e, ast.Constant) else getattr(e, "id", None) for e in value.elts]
        return items if all(isinstance(i, str) for i in items) else None
    return None


@functools.cache
def group_options(group: str) -> list[str] | None:
    """The options of a config group, read from the source (None when they cannot be read): ``recipe`` (the
    catalog's builders, whose function names are the recipe names), ``model`` (``MODEL_CONFIGS``), ``data``
    (``DATA_SOURCES``), ``launcher`` (``LAUNCHERS``), ``experiment`` (the files of conf/experiment/)."""
    if group == "recipe":
        return _literal_list("lowprec.recipes.catalog", "_BUILDERS")
    if group == "model":
        return _literal_keys("lowprec.model", "MODEL_CONFIGS")
    if group == "data":
        return _literal_keys(CONFIG_MODULE, "DATA_SOURCES")
    if group == "launcher":
        return _literal_keys("lowprec_lab.plan.launcher", "LAUNCHERS")
    if group == "experiment":
        f = _module_file(CONFIG_MODULE)
        folder = f.parents[2] / "conf" / "experiment" if f else None
        return sorted(p.stem for p in folder.glob("*.yaml")) if folder and folder.is_dir() else None
    return None


def nearest(word: str, choices: list[str]) -> list[str]:
    """The names of ``choices`` nearest to ``word`` (difflib ratio >= 0.6, and within 0.1 of the best one: a
    near-miss names its match alone), compared on the last dotted part when both have the same prefix."""

    def leaf(s: str) -> str:
        return s.rpartition(".")[2]

    prefix = word.rpartition(".")[0]
    same = [c for c in choices if c.rpartition(".")[0] == prefix]
    pool = {leaf(c): c for c in same} if prefix and same else {c: c for c in choices}
    target = leaf(word) if prefix and same else word
    close = difflib.get_close_matches(target, list(pool), n=3, cutoff=0.6)
    if not close:
        return []
    best = difflib.SequenceMatcher(None, target, close[0]).ratio()
    return [pool[c] for c in close if difflib.SequenceMatcher(None, target, c).ratio() >= best - 0.1]


def did_you_mean(word: str, choices: list[str]) -> str:
    """``", did you mean a or b?"`` for the names of ``choices`` nearest to ``word`` (``nearest``), else ``""``."""
    close = nearest(word, choices)
    return f", did you mean {' or '.join(close)}?" if close else ""


#: what an option of each group is called in a message
NOUNS = {"data": "data source", "recipe": "recipe", "model": "model", "experiment": "experiment"}


def unknown_option(group: str, name: str, choices: list[str]) -> str:
    """The one line for an option of ``group`` that does not exist, the same for every command and for both
    ``recipe=`` and ``recipes=[...]``: ``unknown recipe 'fp8_rowwse', did you mean fp8_rowwise? known: ...``."""
    hint = did_you_mean(name, choices)
    more = " (lowprec recipes describes each)" if group == "recipe" else ""
    sep = " " if hint else "; "
    return f"unknown {NOUNS.get(group, group)} {name!r}{hint}{sep}known: {', '.join(choices)}{more}"


def check_option(group: str, name: str) -> None:
    """Refuse (``UnknownNameError``) an option of ``group`` that the source does not define; nothing when the
    options cannot be read."""
    choices = group_options(group)
    if choices is not None and name not in choices:
        raise UnknownNameError(unknown_option(group, name, choices))


def split_list(value: str) -> list[str] | None:
    """The items of a plain bracketed list ``[a,b]`` (quotes around an item dropped); None for anything else (an
    interpolation, a nested list: Hydra reads those)."""
    if not (value.startswith("[") and value.endswith("]")) or any(c in value[1:-1] for c in "[]{}$"):
        return None
    return [i.strip().strip("'\"") for i in value[1:-1].split(",") if i.strip()]


def _check_key(command: str, key: str, tree: dict) -> None:
    node, path = tree, []
    for part in key.split("."):
        if node is None or node is True:
            return  # an open node, or a leaf's sub-key (Hydra says what is wrong with that)
        if part not in node:
            full = ".".join([*path, part])
            names = [".".join([*path, k]) for k in node if k != "hydra"]
            hint = did_you_mean(full, names)
            where = f"{'.'.join(path)}." if path else ""
            if not hint:
                hint = f"; the {where}* keys: {', '.join(names)}" if len(names) <= 12 else ""
            raise UnknownNameError(f"unknown key {full}{hint} (lowprec {command} --help lists every key)")
        node, path = node[part], [*path, part]


def precheck(command: str, overrides: list[str]) -> None:
    """Refuse, before Hydra and torch are imported, the arguments of ``lowprec train`` / ``lowprec ablate`` that
    name something that does not exist: an unknown key (``train.step``: did you mean ``train.steps``), an unknown
    recipe, model, experiment, data source or launcher (with the nearest names), ``recipe=`` given to ``ablate``
    (it takes ``recipes=[...]``) or ``recipes=`` to ``train``, and a comma list without brackets
    (``recipes=a,b`` is a Hydra sweep, refused outside ``-m``). Raises ``UnknownNameError`` / ``ConfigError``
    (one line); what it cannot be sure of is left to Hydra."""
    tree = schema(command)
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if not sep or key.startswith(("+", "~")) or "@" in key or "/" in key or not key or value == "null":
            continue  # `+key=` adds a key, `~key` deletes one, `group@pkg`, `hydra/group=`: Hydra's rules
        if command == "ablate" and (key == "recipe" or key.startswith("recipe.")):
            named = f"'recipes=[{value}]'" if key == "recipe" and value else "'recipes=[a,b]'"
            raise ConfigError(
                f"{key}=: lowprec ablate runs a list of recipes, given as {named} "
                "(lowprec train recipe=NAME runs one; recipe.<group>.<field>= overrides need lowprec train)"
                if key.startswith("recipe.")
                else f"recipe=: lowprec ablate runs a list of recipes, given as {named} (lowprec train runs one)"
            )
        if command == "train" and key in ("recipes", "models", "seeds"):
            raise ConfigError(
                f"{key}= is a key of lowprec ablate; lowprec train runs one recipe=NAME model=SIZE seed=N"
            )
        if key in ("recipes", "models") and value and not value.startswith(("[", "$", "'", '"')):
            items = ",".join(i.strip() for i in value.split(","))
            raise ConfigError(
                f"{key}={value}: {key}= takes a list, in brackets: '{key}=[{items}]' (quoted for the shell; "
                "a bare comma list is a Hydra sweep)"
            )
        if tree is not None and "." in key:
            _check_key(command, key, tree)
        elif tree is not None and key not in tree and group_options(key) is None:
            _check_key(command, key, tree)
        if key in ("recipe", "model", "experiment", "data", "launcher") and _NAME.fullmatch(value):
            check_option(key, value)
        elif key in ("recipes", "models"):
            for item in split_list(value) or []:
                if _NAME.fullmatch(item):
                    check_option(key[:-1], item)
