"""The ``resume it:`` line a stopped command prints is a command that works as printed: its ``resume=`` value is
quoted for Hydra (a comma in a runs path would make a sweep of it, a space would end it) and then for the shell.
The printing path of the real command (``_run_composed``) with a runs folder whose path holds a comma and a space."""

from __future__ import annotations

import shlex
import signal

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from stop_handlers import restored_stop_handlers

from lowprec.train.stop import StopSignal
from lowprec_lab.cli import _run_composed, compose, hydra_value

RUN = ["model=debug", "recipe=fp32", "train.steps=4", "train.checkpoint_on_signal=true"]


def _printed_resume(config_name: str, argv: list[str], stop: StopSignal, capsys) -> list[str]:
    """The argv of the ``resume it:`` line that ``lowprec <config_name> <argv>`` prints when its task is stopped
    by ``stop`` (the run itself is not what is tested here: tests/faults/test_signals.py trains and stops one)."""

    def stopped(plan):
        raise stop

    with restored_stop_handlers():
        assert _run_composed(config_name, argv, stopped) == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"resume it: lowprec {config_name} "), line
    return shlex.split(line.removeprefix("resume it: "))[2:]


def test_the_printed_resume_line_gives_hydra_the_exact_checkpoint_path(tmp_path, capsys):
    runs = tmp_path / "lab, shared" / "runs"
    dirs = [f"paths.runs='{runs}'", f"paths.reports='{tmp_path / 'reports'}'", "train.progress=false"]
    dirs += [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    ckpt = runs / "checkpoints" / "run, 1" / "step_2"
    argv = _printed_resume("train", [*RUN, *dirs], StopSignal(signal.SIGTERM, 1, ckpt), capsys)
    (resume,) = [a for a in argv if a.startswith("resume=")]
    assert OverridesParser.create().parse_overrides([resume])[0].value() == str(ckpt)
    cfg = compose("train", argv)  # and the rest of the printed command composes with it
    assert cfg.resume == str(ckpt) and cfg.paths.runs == str(runs)


@pytest.mark.parametrize(
    "value", ["/r/a,b c/step_3", "null", "1e5", "it's", "tail\\", "x'\\", "[x]", "a${x}", "a\\${x}", "{a: b}"]
)
def test_a_value_hydra_would_read_otherwise_is_quoted_back_to_itself(value):
    assert compose("train", [f"resume={hydra_value(value)}"]).resume == value


def test_a_plain_value_stays_as_it_is():
    assert hydra_value("abl-20261126-000000-abcd") == "abl-20261126-000000-abcd"
    assert hydra_value("/tmp/runs/ckpt/step_4") == "/tmp/runs/ckpt/step_4"
