"""The ablation's progress display (lowprec_lab/runner/progress.py) as a terminal shows it: one bar per worker on
its own row, the overall line, result lines above the bars; worker lines arrive through the real pipes."""

import io
import time

from rich.console import Console
from tqdm import tqdm
from vt_screen import Screen

from lowprec.train.meter import StepReport, reporting_steps, step_bar
from lowprec_lab.runner.progress import AblationProgress, WorkerChannel, clock


def _terminal() -> tuple[io.StringIO, Console]:
    out = io.StringIO()
    return out, Console(file=out, force_terminal=True, width=100, color_system="standard")


def _frames(raw: str) -> list[list[str]]:
    """The screen as it stands before each line erase (a redraw of the live area starts with erases)."""
    screen, frames = Screen(100), []
    for i, part in enumerate(raw.split("\x1b[2K")):
        screen.feed(part if i == 0 else "\x1b[2K" + part)
        frames.append(screen.lines())
    return frames


def _wait_for(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout:
        time.sleep(0.02)


def test_two_workers_get_a_row_each_and_results_print_above_the_bars(monkeypatch):
    out, console = _terminal()
    monkeypatch.setattr("sys.stdout", type("Tty", (io.StringIO,), {"isatty": lambda self: True})())
    display = AblationProgress(live=True, console=console)
    with display:
        display.add_runs(3)
        chans = [WorkerChannel(display.channel(slot)) for slot in (0, 1)]  # as a worker process holds them
        for chan, recipe in zip(chans, ("fp32", "bf16"), strict=True):
            chan.run_started(recipe, 0)
            for n in range(1, 6):
                chan.send(("step", StepReport(recipe, n, 10, (("loss", "9.100"),))))
        _wait_for(lambda: display._fractions == {0: 0.5, 1: 0.5})  # both workers' 5 of 10 steps drained
        display.progress.refresh()
        chans[0].send(("text", "stderr", "a warning from worker 0"))
        chans[0].send(("step", StepReport("fp32", 10, 10, closed=True)))
        _wait_for(lambda: display._fractions.get(0) == 1.0)
        display.result("  fp32             seed 0: val_loss 9.1000")
        display.run_ended(0)
        display.progress.refresh()
    frames = _frames(out.getvalue())
    for rows in frames:  # each worker's bar on a row of its own, never two bars on one row
        assert all(sum(r.startswith(f"  worker {i}:") for r in rows) <= 1 for i in (0, 1))
        assert not any(r.count("worker") > 1 or r.count("━") > 24 for r in rows)
    both = [
        rows
        for rows in frames
        if any(r.startswith("  worker 0: fp32 seed 0 ") and "5/10 steps  loss 9.100" in r for r in rows)
        and any(r.startswith("  worker 1: bf16 seed 0 ") and "5/10 steps" in r for r in rows)
        and any(r.startswith("runs ") and "0/3 runs done" in r and "elapsed" in r and "left" in r for r in rows)
    ]
    assert both, "never both workers' bars and the overall line at once"
    final = frames[-1]
    (res,) = [r for r in final if "seed 0: val_loss" in r]
    assert res.startswith("  fp32             seed 0: val_loss 9.1000  [1/3 runs done, ") and "━" not in res
    assert "a warning from worker 0" in final
    assert not any("worker" in r and "━" in r for r in final)  # the bars are gone once the display ends


def test_the_time_left_comes_from_the_share_of_runs_done():
    display = AblationProgress(live=False)
    display.add_runs(4)
    display._t0 -= 60.0  # one minute in
    assert display.times().endswith("estimating time left")
    display.done, display._fractions = 1, {0: 0.5}  # 1.5 runs of 4 in 60 s: 2.5 more take 100 s
    assert "1/4 runs done, 1:00 elapsed, ~1:40 left" == display.times()
    assert clock(3725) == "1:02:05"


def test_without_a_terminal_lines_go_to_echo_with_the_tally_and_no_bar_is_drawn():
    lines = []
    display = AblationProgress(lines.append, live=False)
    with display:
        display.add_runs(2)
        assert display.channel(0) is None  # workers keep their own streams, and draw nothing
        with display.in_process(0):  # not live: the loop's own bar (tqdm, shown on a terminal only), as before
            assert isinstance(step_bar(5, 0, "fp32", True), tqdm)
        display.result("  fp32             seed 0: val_loss 9.1")
    assert lines == ["  fp32             seed 0: val_loss 9.1  [1/2 runs done, 0:00 elapsed, ~0:00 left]"]


def test_a_worker_line_cannot_send_escape_sequences_to_the_terminal(monkeypatch):
    out, console = _terminal()
    display = AblationProgress(live=True, console=console)
    with display:
        chan = WorkerChannel(display.channel(0))
        chan.send(("text", "stderr", "red \x1b[31malert\x1b[2J"))
        _wait_for(lambda: "alert" in out.getvalue())
    assert "\x1b[2J" not in out.getvalue() and "\x1b[31malert" not in out.getvalue()


def test_step_bar_reports_to_the_installed_reporter_instead_of_drawing():
    got = []
    with reporting_steps(got.append):
        bar = step_bar(3, 1, "bf16", True)
        bar.update(1)
        bar.set_postfix(loss="9.000")
        bar.close()
    assert got == [
        StepReport("bf16", 1, 3),
        StepReport("bf16", 2, 3, (("loss", "9.000"),)),
        StepReport("bf16", 2, 3, (("loss", "9.000"),), closed=True),
    ]
    assert isinstance(step_bar(3, 0, "bf16", True), tqdm)  # no reporter: the loop's tqdm bar, as before
    assert isinstance(step_bar(3, 0, "bf16", False), tqdm)


def test_a_worker_whose_ablation_is_gone_writes_to_its_own_stream():
    display = AblationProgress(live=True, console=_terminal()[1])
    writer = display.channel(0)
    for reader in list(display._readers):
        reader.close()
    chan = WorkerChannel(writer)
    fallback = io.StringIO()
    from lowprec_lab.runner.progress import _LineWriter

    w = _LineWriter(chan, "stderr", fallback)
    w.write("still shown\n")
    assert fallback.getvalue() == "still shown\n"


def test_the_verdict_summary_reads_the_parent_run_and_shows_store_strings_as_text(tmp_path):
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from lowprec_lab.runner.ablate import verdict_summary

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("lowprec", artifact_location=str(tmp_path / "a"))).info.run_id
    tags = {
        "verdict_status": "ok",
        "verdict_control": "bf16",
        "verdict_label.fp8": "inferior\x1b[2J\x1b[32m ok",
        "stability.fp8": "as stable",
        "verdict.fp32": "no-interval",
        "stability.fp32": "no test possible",
    }

    for k, v in tags.items():
        client.set_tag(run, k, v)
    for k, v in {"verdict/margin": 0.0025, "verdict/effect.fp8": 0.004, "verdict/lo.fp8": 0.003,
                 "verdict/hi.fp8": 0.005, "verdict/effect.fp32": -1e-5}.items():  # fmt: skip
        client.log_metric(run, k, v)
    tracker = SimpleNamespace(client=client)
    lines = verdict_summary(tracker, run, ["fp8", "fp32"])
    assert lines[0].startswith("controls: none; nothing shows the experiment could see a difference at the 0.250%")
    lines = lines[1:]
    assert lines[0] == "verdicts on the final validation loss vs bf16 (margin 0.250%); + is worse:"
    assert lines[2].split()[:4] == ["fp8", "+0.400%", "[+0.300%,", "+0.500%]"]
    assert lines[2].endswith("inferior [2J [32m ok; stability: as stable")  # the tag's escapes are text
    assert "\x1b" not in "".join(lines)
    assert lines[3].split() == ["fp32", "-0.001%", "no-interval;", "stability:", "no", "test", "possible"]
    # the controls' outcome, first: passed, or the experiment could not tell (their labels read as text)
    for k, v in {"verdict_negative_control": "neg", "verdict_positive_control": "pos",
                 "verdict_label.neg": "non-inferior\x1b[2J", "verdict_label.pos": "inferior"}.items():  # fmt: skip
        client.set_tag(run, k, v)
    client.set_tag(run, "verdict_controls", "passed")
    first = verdict_summary(tracker, run, ["fp8"])[0]
    assert first == "controls passed at the 0.250% margin (negative neg: non-inferior [2J, positive pos: inferior)"
    client.set_tag(run, "verdict_controls", "failed")
    client.set_tag(run, "verdict_label.pos", "inconclusive")
    first = verdict_summary(tracker, run, ["fp8"])[0]
    assert first.startswith("THE EXPERIMENT COULD NOT TELL at the 0.250% margin: a control failed (negative neg: ")
    assert "positive pos: inconclusive); its verdicts are not evidence" in first
    client.set_tag(run, "verdict_status", "no-control")
    client.set_tag(run, "verdict_reason", "no finished control run\nnext line")
    assert verdict_summary(SimpleNamespace(client=client), run, ["fp8"]) == [
        "no verdicts: no finished control run next line"
    ]


def test_a_worker_sends_its_prints_log_records_and_steps_through_its_pipe(monkeypatch):
    import logging
    import sys
    from multiprocessing import Pipe

    from lowprec.train.meter import install_step_reporter

    fake_out, fake_err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", fake_out)
    monkeypatch.setattr(sys, "stderr", fake_err)
    logger = logging.getLogger("lowprec.test.worker_logs")
    handler = logging.StreamHandler(sys.stderr)  # as MLflow's handler, made at import on the stderr of then
    logger.addHandler(handler)
    reader, writer = Pipe(duplex=False)
    try:
        WorkerChannel(writer).install()
        print("a line", "on stdout")
        logger.warning("a record")
        step_bar(4, 0, "fp32", True).set_postfix(loss="9.0")
    finally:
        install_step_reporter(None)
        logger.removeHandler(handler)
    got = []
    while reader.poll(0.5):
        got.append(reader.recv())
    assert ("text", "stdout", "a line on stdout") in got and ("text", "stderr", "a record") in got
    assert ("step", StepReport("fp32", 0, 4, (("loss", "9.0"),))) in got
    assert fake_out.getvalue() == fake_err.getvalue() == ""  # nothing written past the pipe
