#!/usr/bin/env python
"""Mutation testing of lowprec's numerics and precision core, with mutmut 3 (not part of the normal test run).

What it does
    For each module group below it makes a scratch copy of the repository (``git archive HEAD`` by default,
    or the current working tree with ``--from-worktree``), writes a ``[tool.mutmut]`` section into the
    *copy's* pyproject.toml that mutates only that group's files and selects only that group's fast tests,
    and runs ``mutmut run`` there. The working tree is never mutated: mutmut writes its mutants under
    ``<scratch>/<group>/mutants/`` and the tests import ``lowprec`` from there (checked before the run).
    It prints ``module | mutants | killed | survived | timeout/suspicious | no tests`` per module, appends
    each group's rows to ``--progress`` as soon as the group finishes, writes the survivors with their diffs
    to ``<scratch>/survivors.txt`` and the table to ``<scratch>/summary.txt``, and removes the per-group
    copies (``--keep`` leaves them, to inspect a mutant with ``mutmut show NAME`` inside one).

    Groups and their tests (each group's tests run in well under a minute on one core):
      formats     lowprec/formats.py             tests/numerics/test_formats_scaling.py, test_fp8_linear.py
      scaling     lowprec/scaling.py             the same two, test_telemetry.py
                  (or lowprec/numerics/{formats,scaling}.py, where the tree has them)
      float8      lowprec/float8/*.py            test_fp8_linear.py, test_formats_scaling.py, test_telemetry.py
      loss_scale  lowprec/optim/loss_scale.py    tests/unit/test_optim_components.py (+ tests/unit/test_loss_scale.py
                                                 when present)
      master      lowprec/optim/master.py        tests/unit/test_optim_components.py
      effective   lowprec/train/effective.py     tests/unit/test_state_after_one_step.py
    tests/distributed is left out (multi-process, slow); so are the integration runs.
    ``tests/numerics/test_mutation_gaps.py`` (tests written against earlier survivors) is added to every group.

How mutants are made
    mutmut 3 mutates inside functions only (operators, comparisons, constants, strings, keyword arguments,
    ``None`` returns, ...), one mutant per change, and runs, for each mutant, only the tests that executed
    the mutated function (recorded in a first, unmutated run), fastest first, stopping at the first failure.
    mutmut skips functions carrying decorators other than ``@staticmethod``/``@classmethod``. Since the core
    puts ``@torch.no_grad()`` on many of its numerics (``amax_to_scale``, ``compute_amax``,
    ``DelayedScaler.update``, ``unscale_``, ``before_step``/``after_step``, ...), the scratch copy first
    rewrites each ``@torch.no_grad()`` function into the equivalent ``with torch.no_grad():`` body (same
    behaviour, only in the copy) so those functions are mutated too. ``@property`` bodies stay unmutated.
    The transformer-engine adapter (``lowprec/float8/te.py``) is GPU-only: its mutants have no test on CPU
    and are counted under "no tests".

Usage
    .venv/bin/python scripts/mutation.py                      # all groups, from HEAD
    .venv/bin/python scripts/mutation.py formats master       # some groups
    .venv/bin/python scripts/mutation.py --from-worktree      # include uncommitted changes
    .venv/bin/python scripts/mutation.py --sample 0.5         # run a random half of each group's mutants
    .venv/bin/python scripts/mutation.py --max-minutes 10     # stop each group's mutants after 10 min
    Options: --scratch DIR (default /tmp/lowprec-mutation), --progress FILE, --jobs N (mutmut children,
    default 2), --seed N (for --sample), --keep. mutmut checks the mutants with the cheapest tests first.
    Installs mutmut (the ``mutation`` extra) into the running interpreter if missing.
    Run it under ``nice`` on a shared machine. Exit status 0 whatever survives (it measures; it gates nothing).

Cost
    About 1,900 mutants in all (formats 45, scaling 245, float8 ~830, loss_scale 223, master 295, effective
    ~300). On 2 AMD EPYC cores shared with other jobs (``nice -n 19``) mutmut managed 0.1-0.5 mutants/s:
    formats took 3.3 min, scaling 8.7 min, and a full run of everything would take 2-3 hours there. On such
    a machine sample the big groups, e.g. ``--sample float8=0.25,master=0.5,effective=0.3``; on a free
    8-16 core machine use ``--jobs`` = cores and run in full. The first (2026-11) run's figures, with the
    samples it used, are in the closing note of the mutation-testing issue.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT_SPEC = "mutmut==3.8.1"

NUMERICS = ["tests/numerics/test_formats_scaling.py", "tests/numerics/test_fp8_linear.py"]
GAPS = "tests/numerics/test_mutation_gaps.py"
#: group -> (files to mutate, test files/node selections, mutant-name prefix per reported module)
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "formats": (["lowprec/formats.py"], NUMERICS),
    "scaling": (["lowprec/scaling.py"], NUMERICS + ["tests/numerics/test_telemetry.py"]),
    "float8": (["lowprec/float8/*.py"], NUMERICS + ["tests/numerics/test_telemetry.py"]),
    "loss_scale": (
        ["lowprec/optim/loss_scale.py"],
        ["tests/unit/test_optim_components.py", "tests/unit/test_loss_scale.py"],
    ),
    "master": (["lowprec/optim/master.py"], ["tests/unit/test_optim_components.py"]),
    # three recipes compile kernels (torch.compile / torchao) for ~2.5 min between them; the other 15 cover
    # the same effective-recipe code paths
    "effective": (
        ["lowprec/train/effective.py"],
        [
            "tests/unit/test_state_after_one_step.py",
            "-k",
            "not bf16_adamw8bit_ao and not bf16_sr and not bf16_adamw4bit",
        ],
    ),
}
for _files, _tests in GROUPS.values():
    _tests.insert(0, GAPS)
#: functions only called at import time: a mutant of them is never active in mutmut's forked workers (the
#: module is imported before the mutant is chosen), so it would "survive" whatever the tests check.
IMPORT_TIME = {"lowprec/formats.py": ["_fmt"]}
KINDS = ("killed", "survived", "timeout/suspicious", "no tests", "other")


def _kind(status: str) -> str:
    if status in ("killed", "survived", "no tests"):
        return status
    if status in ("timeout", "suspicious", "segfault"):
        return "timeout/suspicious"
    return "other"  # not checked, skipped, interrupted


# ---- scratch copy ---------------------------------------------------------------------------------------


def make_copy(dest: Path, from_worktree: bool) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if from_worktree:
        files = (
            subprocess.run(
                ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"], check=True, capture_output=True
            )
            .stdout.decode()
            .split("\0")
        )
        for f in filter(None, files):
            src = ROOT / f
            if src.is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f)
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def unwrap_no_grad(path: Path) -> int:
    """Rewrite every ``@torch.no_grad()``-decorated function of ``path`` into a ``with torch.no_grad():`` body
    (mutmut does not mutate decorated functions). Returns how many were rewritten."""
    import libcst as cst
    import libcst.matchers as m

    no_grad = m.Decorator(decorator=m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("no_grad")), args=[]))

    class T(cst.CSTTransformer):
        n = 0

        def leave_FunctionDef(self, orig: cst.FunctionDef, node: cst.FunctionDef) -> cst.FunctionDef:
            if not any(m.matches(d, no_grad) for d in node.decorators):
                return node
            T.n += 1
            body = list(node.body.body)
            head = []
            if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])):
                head = [body.pop(0)]  # keep the docstring
            with_ = cst.With(
                items=[cst.WithItem(cst.parse_expression("torch.no_grad()"))], body=cst.IndentedBlock(body=body)
            )
            return node.with_changes(
                decorators=[d for d in node.decorators if not m.matches(d, no_grad)],
                body=node.body.with_changes(body=[*head, with_]),
            )

    tree = cst.parse_module(path.read_text())
    path.write_text(tree.visit(T()).code)
    return T.n


def mutmut_config(files: list[str], tests: list[str], work: Path) -> str:
    tests = [t for t in tests if t.startswith("-") or not t.startswith("tests/") or (work / t.split("::")[0]).exists()]
    toml_list = lambda xs: "[" + ", ".join(json.dumps(x) for x in xs) + "]"  # noqa: E731
    return (
        "\n\n[tool.mutmut]\n"
        'source_paths = ["lowprec/"]\n'
        f"only_mutate = {toml_list(files)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        # the project's addopts (-ra, markers) stay; no cache writes in the copy
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
        # a mutant counts as a timeout after 5 x (its tests' recorded time + 10 s) of wall time (twice that in CPU
        # time); the 10 s absorb a forked pytest's start-up on a loaded machine, which the recorded times omit
        "timeout_multiplier = 5.0\n"
        "timeout_constant = 10.0\n"
        # torch is not fork-safe after use: fork the workers from a clean server process
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
    )


# ---- running --------------------------------------------------------------------------------------------


def ensure_mutmut() -> None:
    try:
        import mutmut  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", MUTMUT_SPEC], check=True)


def mutmut(work: Path, *args: str, log=None, minutes: float | None = None) -> subprocess.CompletedProcess:
    """``python -m mutmut ARGS`` in ``work``; with ``minutes``, stopped (its whole process group) after that long,
    keeping the results of the mutants checked so far."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "mutmut", *args]
    if log is None:
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        rc = proc.wait(timeout=None if minutes is None else minutes * 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        rc = proc.wait()
        log.write(f"\n# stopped after {minutes} min (--max-minutes)\n")
    return subprocess.CompletedProcess(cmd, rc)


def results(work: Path) -> dict[str, str]:
    out = mutmut(work, "results", "--all", "true").stdout
    return dict(re.findall(r"^\s+(\S+): (.+)$", out, flags=re.M))


def module_of(mutant: str) -> str:
    # lowprec.numerics.scaling.xǁDelayedScalerǁupdate__mutmut_3 -> lowprec/scaling.py
    mod = mutant.split(".x")[0] if ".x" in mutant else mutant.rsplit(".", 1)[0]
    return mod.replace(".", "/") + ".py"


def _resolve(work: Path, path: str) -> str:
    """``lowprec/formats.py`` -> ``lowprec/numerics/formats.py`` in trees where it moved there."""
    moved = path.replace("lowprec/", "lowprec/numerics/", 1)
    return moved if not any(work.glob(path)) and any(work.glob(moved)) else path


def run_group(
    name: str,
    scratch: Path,
    from_worktree: bool,
    jobs: int,
    sample: float,
    seed: int,
    progress: Path,
    max_minutes: float | None = None,
) -> tuple[dict[str, str], float]:
    work = scratch / name
    make_copy(work, from_worktree)
    files = [_resolve(work, f) for f in GROUPS[name][0]]
    tests = GROUPS[name][1]
    n = sum(unwrap_no_grad(p) for pat in files for p in sorted(work.glob(pat)))
    for rel, funcs in IMPORT_TIME.items():
        rel = _resolve(work, rel)
        if (work / rel) in {p for pat in files for p in work.glob(pat)}:
            src = (work / rel).read_text()
            for fn in funcs:
                src = re.sub(rf"^(def {fn}\(.*:)$", r"\1  # pragma: no mutate block", src, flags=re.M)
            (work / rel).write_text(src)
    with open(work / "pyproject.toml", "a") as f:
        f.write(mutmut_config(files, tests, work))
    # The copy's lowprec must be what the tests import (lowprec is installed editable from the real tree).
    probe = subprocess.run(
        [sys.executable, "-c", "import lowprec; print(lowprec.__file__)"],
        cwd=work,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=""),
    )
    if not probe.stdout.strip().startswith(str(work)):
        raise SystemExit(f"{name}: lowprec imports from {probe.stdout.strip()!r}, not the scratch copy {work}")
    t0 = time.time()
    log = open(scratch / f"{name}.log", "w")
    log.write(f"# {name}: {n} @torch.no_grad() functions unwrapped\n")
    log.flush()
    if sample < 1.0:
        # mutmut generates every mutant and records the test map before it filters by name: a run filtered on a
        # name that matches nothing does just that, then the sampled names run (the test map is reused)
        mutmut(work, "run", "--max-children", str(jobs), "__no_such_mutant__", log=log)
        names = sorted(
            k
            for meta in (work / "mutants").rglob("*.py.meta")
            for k in json.loads(meta.read_text())["exit_code_by_key"]
        )
        chosen = sorted(random.Random(seed).sample(names, max(1, round(sample * len(names)))))
        log.write(f"# sampled {len(chosen)} of {len(names)} mutants (seed {seed})\n")
        log.flush()
        r = mutmut(work, "run", "--max-children", str(jobs), *chosen, log=log, minutes=max_minutes)
    else:
        r = mutmut(work, "run", "--max-children", str(jobs), log=log, minutes=max_minutes)
    log.close()
    res = results(work)
    if sample < 1.0:
        res = {k: v for k, v in res.items() if k in set(chosen)}
    n_all = len(res)
    res = {k: v for k, v in res.items() if v != "not checked"}  # left when stopped by --max-minutes
    wall = time.time() - t0
    if r.returncode != 0 and not res:
        raise SystemExit(f"{name}: mutmut failed (rc {r.returncode}); see {scratch / f'{name}.log'}")
    with open(scratch / "survivors.txt", "a") as f:
        for k, v in sorted(res.items()):
            if _kind(v) in ("survived", "timeout/suspicious"):
                f.write(f"## {k}: {v}\n{mutmut(work, 'show', k).stdout.strip()}\n\n")
    with open(progress, "a") as f:
        for line in table(res, header=False):
            f.write(line + "\n")
        f.write(
            f"# group {name}: {len(res)} mutants"
            + (f" (random {sample:.0%} sample)" if sample < 1 else "")
            + (f", stopped with {n_all - len(res)} unchecked" if n_all > len(res) else "")
            + f" in {wall / 60:.1f} min (rc {r.returncode})\n"
        )
    return res, wall


def table(res: dict[str, str], header: bool = True) -> list[str]:
    by_mod: dict[str, Counter] = {}
    for k, v in res.items():
        by_mod.setdefault(module_of(k), Counter())[_kind(v)] += 1
    lines = []
    if header:
        lines.append("module | mutants | killed | survived | timeout/suspicious | no tests")
    for mod in sorted(by_mod):
        c = by_mod[mod]
        lines.append(
            f"{mod} | {sum(c.values())} | {c['killed']} | {c['survived']} | {c['timeout/suspicious']} | "
            f"{c['no tests']}" + (f" | other {c['other']}" if c["other"] else "")
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "groups",
        nargs="*",
        choices=[[], *GROUPS],
        default=[],
        metavar="GROUP",
        help=f"groups to run (default all): {', '.join(GROUPS)}",
    )
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/lowprec-mutation"))
    ap.add_argument(
        "--progress",
        type=Path,
        default=None,
        help="per-module rows appended as groups finish (default <scratch>/progress.txt)",
    )
    ap.add_argument("--from-worktree", action="store_true", help="copy the working tree, not HEAD")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--sample",
        default="1.0",
        help="share of each group's mutants to run: 0.5, or per group "
        "as float8=0.5,effective=0.5 (the others run in full)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop each group's mutant run after this long and report the mutants checked so far",
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    a = ap.parse_args()
    groups = a.groups or list(GROUPS)
    ensure_mutmut()
    a.scratch.mkdir(parents=True, exist_ok=True)
    progress = a.progress or a.scratch / "progress.txt"
    (a.scratch / "survivors.txt").touch()
    with open(progress, "a") as f:
        f.write(
            f"# mutation run {time.strftime('%Y-%m-%d %H:%M:%S')} groups={groups} sample={a.sample}\n"
            "module | mutants | killed | survived | timeout/suspicious | no tests\n"
        )
    all_res: dict[str, str] = {}
    t0 = time.time()
    if "=" in a.sample:
        share = {g: 1.0 for g in GROUPS} | {k: float(v) for k, v in (kv.split("=") for kv in a.sample.split(","))}
    else:
        share = {g: float(a.sample) for g in GROUPS}
    for g in groups:
        res, wall = run_group(g, a.scratch, a.from_worktree, a.jobs, share[g], a.seed, progress, a.max_minutes)
        all_res.update(res)
        print(f"{g}: {len(res)} mutants, {wall / 60:.1f} min", flush=True)
        if not a.keep:
            shutil.rmtree(a.scratch / g, ignore_errors=True)
    lines = table(all_res) + [f"total wall {(time.time() - t0) / 60:.1f} min; survivors: {a.scratch / 'survivors.txt'}"]
    (a.scratch / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
