"""The repository stands alone: no tracked file points at a folder beside it (a sibling ``shared`` folder) or at an
absolute path of the machine it was written on (the README and lowprec_lab/report/html_check.py once did)."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Built from pieces, so that this file does not match itself.
OUTSIDE = re.compile(r"\.\./" + "shared" + r"\b|(?<![\w.~-])/" + "work" + r"/")


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.decode().split("\0") if p]


def test_no_tracked_file_points_outside_the_repository():
    found = []
    for path in _tracked():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (a figure), or deleted in the work tree
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, "\n".join(found)
