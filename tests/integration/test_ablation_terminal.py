"""``lowprec ablate`` on a terminal (a real pseudo-terminal, a real 2-worker ablation): one bar per worker on a row
of its own, an overall progress line, each run's result line on its own row, and the verdicts and both report paths
at the end."""

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from store_dirs import dirs_under
from vt_screen import Screen

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 240  # wide enough that the report paths under pytest's temporary folder are not wrapped


def _run_in_pty(args: list[str], timeout_s: float = 600) -> str:
    """``python -m lowprec_lab ARGS`` with stdin, stdout and stderr on one pseudo-terminal; returns what it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, WIDTH, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm", "COLUMNS": str(WIDTH)}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowprec_lab", *args], stdin=follower, stdout=follower, stderr=follower, env=env,
        cwd=ROOT, close_fds=True,
    )  # fmt: skip
    os.close(follower)
    out, t0 = b"", time.monotonic()
    try:
        while time.monotonic() - t0 < timeout_s:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 1 << 16)
                except OSError:  # EIO: every writer of the terminal has closed it
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, out.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    return out.decode(errors="replace")


def _frames(raw: str) -> list[list[str]]:
    """The screen as it stands before each line erase (each redraw of the bars starts with erases), and at the end."""
    screen, frames = Screen(WIDTH), []
    for i, part in enumerate(raw.split("\x1b[2K")):
        screen.feed(part if i == 0 else "\x1b[2K" + part)
        frames.append(screen.lines())
    return frames


def test_a_two_worker_ablation_on_a_terminal_draws_a_bar_per_worker_and_states_the_verdicts(tmp_path):
    dirs = [d for d in dirs_under(tmp_path) if d != "train.progress=false"]  # the bars are what is tested
    raw = _run_in_pty(
        ["ablate", "controls=false", "recipes=[fp32,bf16]", "seeds=2", "workers=2", "model=debug",
         "model.qk_norm=false", "train.steps=20",
         "train.batch_size=2", "train.seq_len=64", "train.val_every=10", "train.val_batches=1",
         "train.warmup_steps=1", "train.timing_warmup_steps=1", "train.telemetry_every=0", *dirs]
    )  # fmt: skip
    frames = _frames(raw)
    bar_rows = [r for rows in frames for r in rows if re.match(r"  worker \d: ", r)]
    for rows in frames:  # every worker's bar on a row of its own, never two on a row nor one after other text
        for w in ("worker 0:", "worker 1:"):
            assert sum(r.startswith(f"  {w}") for r in rows) <= 1
        assert not any(r.count("worker") > 1 for r in rows)
        assert not any("%|" in r for r in rows)  # no tqdm bar of a worker's own
    # both workers had their bar, with the run it trains and its steps
    for w in (0, 1):
        assert any(re.match(rf"  worker {w}: (fp32|bf16) seed [01] .*━.* \d+/20 steps", r) for r in bar_rows), w
    overall = [r for rows in frames for r in rows if r.startswith("runs ")]
    assert any(re.search(r"[0-3]/4 runs done, \d+:\d\d elapsed, ~\d+:\d\d left", r) for r in overall)
    final = frames[-1]
    results = [r for r in final if ": val_loss " in r]
    assert len(results) == 4  # each on its own row, starting with its recipe, after no bar
    for r in results:
        assert re.match(r"  (fp32|bf16) +seed [01]: val_loss \d\.\d{4} .*\[\d/4 runs done, ", r), r
        assert "━" not in r and "worker" not in r
    assert not any(re.match(r"  worker \d: ", r) for r in final)  # the bars are gone at the end
    done = final.index(next(r for r in final if re.match(r"ablation abl-[\w-]+ done in \d+ s \(0 failed\)", r)))
    assert final[done + 1].startswith("controls: none; nothing shows the experiment could see a difference")
    done += 1
    assert final[done + 1].startswith("verdicts on the final validation loss vs bf16 (margin 0.250%)")
    assert re.match(r"  fp32 +[+-]\d\.\d{3}% \[[+-]\d\.\d{3}%, [+-]\d\.\d{3}%\] +\S.*; stability: ", final[done + 3])
    assert final[done + 4].startswith("report: ") and final[done + 4].endswith("/report.md")
    assert final[done + 5].strip().endswith("/report.html") and Path(final[done + 5].strip()).is_file()
