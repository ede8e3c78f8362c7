"""Compare two ablations: their report.md text and every run's metric histories (a refactor must change neither).

    python scripts/compare_ablations.py BEFORE_RUNS BEFORE_REPORTS AFTER_RUNS AFTER_REPORTS [--keys loss,val_loss]
        [--before-id abl-...] [--after-id abl-...]

``*_RUNS``: a ``paths.runs`` folder (its ``mlflow.db``); ``*_REPORTS``: a ``paths.reports`` folder. Without an id the
newest ablation of each store is compared. The report texts are compared line by line after masking what differs
from one run of the same command to the next: ablation and run ids, git hashes, the two folders, wall times, and
the measured columns (tokens/s, measured throughput ratios, peak memory, compile time). The metric histories (each
``--keys`` metric of each (recipe, seed), by step) must be equal value for value, and so must every run's params
and ``config.yaml`` artifact (parent and children; the folders masked). Prints what differs; exit 0 when
nothing does, 1 otherwise, 2 for a missing ablation. Reads the sqlite stores with ``sqlite3`` (no MLflow import).
"""

from __future__ import annotations

import argparse
import re
import sqlite3
import sys
from pathlib import Path

#: Table columns whose cells are measurements of this machine's speed or memory, not results of the training.
MEASURED_COLUMNS = re.compile(r"tokens/s|throughput ratio \(measured\)|peak|compile|wall|tflops|mfu", re.I)
MASKS = [
    (re.compile(r"abl-\d{8}-\d{6}-[0-9a-f]{4}"), "<ablation id>"),
    (re.compile(r"\b[0-9a-f]{40}(-dirty)?\b"), "<git>"),  # a worktree with uncommitted changes says -dirty
    (re.compile(r"\b[0-9a-f]{32}\b"), "<run id>"),
    (re.compile(r"wall time: [\d.,]+ s"), "wall time: <s>"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(:\d{2})?"), "<date>"),
]


def ablation(db: Path, ablation_id: str | None) -> tuple[str, str]:
    """``(ablation id, parent run id)``: the one named, else the newest ablation of the store."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute(
        "select t.value, r.run_uuid from runs r join tags t on t.run_uuid = r.run_uuid "
        "join tags k on k.run_uuid = r.run_uuid and k.key = 'lowprec.kind' and k.value = 'ablation' "
        "where t.key = 'lowprec.ablation_id' order by r.start_time desc"
    ).fetchall()
    for aid, run in rows:
        if ablation_id in (None, aid):
            return aid, run
    raise SystemExit(f"no ablation {ablation_id or ''} in {db}")


def histories(db: Path, parent: str, keys: list[str]) -> dict[tuple[str, str, str], list[tuple[int, float]]]:
    """``(recipe, seed, key) -> [(step, value), ...]`` of every child run of ``parent``."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    children = con.execute(
        "select r.run_uuid, rec.value, seed.value from runs r "
        "join tags p on p.run_uuid = r.run_uuid and p.key = 'mlflow.parentRunId' and p.value = ? "
        "join tags rec on rec.run_uuid = r.run_uuid and rec.key = 'recipe' "
        "join tags seed on seed.run_uuid = r.run_uuid and seed.key = 'seed'",
        (parent,),
    ).fetchall()
    out = {}
    for run, recipe, seed in children:
        for key in keys:
            pts = con.execute(
                "select step, value from metrics where run_uuid = ? and key = ? order by step, timestamp",
                (run, key),
            ).fetchall()
            out[(recipe, seed, key)] = [(int(s), float(v)) for s, v in pts]
    return out


def provenance(db: Path, parent: str) -> dict[tuple[str, str], tuple[dict[str, str], str]]:
    """``(recipe, seed) -> (params, config.yaml text)`` of the parent (``("<parent>", "")``) and each child."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute(
        "select r.run_uuid, r.artifact_uri, coalesce(rec.value, '<parent>'), coalesce(seed.value, '') from runs r "
        "left join tags p on p.run_uuid = r.run_uuid and p.key = 'mlflow.parentRunId' "
        "left join tags rec on rec.run_uuid = r.run_uuid and rec.key = 'recipe' "
        "left join tags seed on seed.run_uuid = r.run_uuid and seed.key = 'seed' "
        "where p.value = ? or r.run_uuid = ?",
        (parent, parent),
    ).fetchall()
    out = {}
    for run, uri, recipe, seed in rows:
        params = dict(con.execute("select key, value from params where run_uuid = ?", (run,)).fetchall())
        config = Path(uri.removeprefix("file://")) / "config.yaml"
        out[(recipe, seed)] = (params, config.read_text() if config.is_file() else "")
    return out


def masked(text: str, roots: list[Path]) -> list[str]:
    """``text``'s lines with ids, dates, the folders and the measured table columns masked."""
    for root in roots:
        text = text.replace(str(root.resolve()), "<root>").replace(str(root), "<root>")
    lines, measured = [], set()
    for line in text.splitlines():
        for rx, sub in MASKS:
            line = rx.sub(sub, line)
        if line.startswith("|"):
            cells = line.strip().strip("|").split("|")
            if all(set(c.strip()) <= set("-:") for c in cells):
                pass
            elif not measured and any(MEASURED_COLUMNS.search(c) for c in cells) and not line.startswith("| `"):
                measured = {i for i, c in enumerate(cells) if MEASURED_COLUMNS.search(c)}
            else:
                cells = ["<measured>" if i in measured else c for i, c in enumerate(cells)]
            line = "|" + "|".join(cells) + "|"
        else:
            measured = set()
        lines.append(line)
    return lines


def compare_reports(before: Path, after: Path, roots: list[Path]) -> list[str]:
    """The lines that differ (``-`` before, ``+`` after) once masked."""
    import difflib

    a, b = masked(before.read_text(), roots), masked(after.read_text(), roots)
    return [d for d in difflib.unified_diff(a, b, str(before), str(after), n=0, lineterm="")][2:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before_runs", type=Path)
    p.add_argument("before_reports", type=Path)
    p.add_argument("after_runs", type=Path)
    p.add_argument("after_reports", type=Path)
    p.add_argument("--keys", default="loss,val_loss", help="metrics compared step by step (comma-separated)")
    p.add_argument("--before-id")
    p.add_argument("--after-id")
    a = p.parse_args(argv)
    keys = a.keys.split(",")
    (bid, bparent), (aid, aparent) = (
        ablation(a.before_runs / "mlflow.db", a.before_id),
        ablation(a.after_runs / "mlflow.db", a.after_id),
    )
    print(f"before: {bid} ({a.before_runs}); after: {aid} ({a.after_runs})")
    bad = 0
    hb, ha = histories(a.before_runs / "mlflow.db", bparent, keys), histories(a.after_runs / "mlflow.db", aparent, keys)
    if set(hb) != set(ha):
        bad += 1
        print(f"runs differ: only before {sorted(set(hb) - set(ha))}, only after {sorted(set(ha) - set(hb))}")
    for k in sorted(set(hb) & set(ha)):
        x, y = hb[k], ha[k]
        same = x == y
        worst = max((abs(u[1] - v[1]) for u, v in zip(x, y, strict=False)), default=0.0)
        said = "identical" if same else f"DIFFER (max |d| {worst:.3g})"
        print(f"  {k[0]:<16} seed {k[1]} {k[2]:<9} {len(x):>3} vs {len(y):>3} points: {said}")
        bad += not same
    roots = [a.before_runs, a.before_reports, a.after_runs, a.after_reports]
    pb, pa = provenance(a.before_runs / "mlflow.db", bparent), provenance(a.after_runs / "mlflow.db", aparent)
    for k in sorted(set(pb) | set(pa)):
        (xp, xc), (yp, yc) = pb.get(k, ({}, "")), pa.get(k, ({}, ""))
        xp, yp = ({n: "\n".join(masked(v, roots)) for n, v in d.items()} for d in (xp, yp))
        params = [n for n in sorted(set(xp) | set(yp)) if xp.get(n) != yp.get(n)]
        config = masked(xc, roots) == masked(yc, roots) and bool(xc)
        print(
            f"  {k[0]:<16} seed {k[1] or '-'} params: {'identical' if not params else f'DIFFER {params}'}; "
            f"config.yaml: {'identical' if config else 'DIFFERS'} (folders masked)"
        )
        bad += bool(params) + (not config)
    report_b = a.before_reports / bid / "report.md"
    report_a = a.after_reports / aid / "report.md"
    diff = compare_reports(report_b, report_a, roots)
    n = len(masked(report_b.read_text(), []))
    print(f"report.md: {n} lines; " + ("identical once masked" if not diff else f"{len(diff)} differing line(s):"))
    for line in diff:
        print(f"    {line[:240]}")
    bad += bool(diff)
    print("SAME" if not bad else "DIFFERENT")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
