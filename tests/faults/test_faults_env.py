"""Fault injection is a test channel, the environment variable ``LOWPREC_FAULTS`` (lowprec_lab/runner/faults.py),
never the user's config: its two forms, a bad value refused in one line before any MLflow run exists, and a named
fault point armed through it in a real ``lowprec train`` subprocess."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from fault_env import env_with, injected
from mlflow.tracking import MlflowClient

from lowprec.errors import ConfigError
from lowprec_lab.cli import main
from lowprec_lab.runner.faults import FaultsConfig, from_env, parse

RUN = ["model=debug", "train.batch_size=2", "train.seq_len=64", "train.val_every=0", "train.val_batches=1"]
RUN += ["train.warmup_steps=2", "train.timing_warmup_steps=1", "recipe=fp32", "train.steps=4"]


def test_key_value_and_json_forms_are_the_same_faults():
    want = FaultsConfig(recipe="bf16", kill_at_step=5, fp8_overflow_factor=10.0, at_point=None)
    assert parse("recipe=bf16, kill_at_step=5,fp8_overflow_factor=10,at_point=null") == want
    assert parse('{"recipe": "bf16", "kill_at_step": 5, "fp8_overflow_factor": 10, "at_point": null}') == want
    assert parse("") == parse("  ") == from_env({}) == FaultsConfig()
    assert from_env({"LOWPREC_FAULTS": "nan_at_step=3"}).nan_at_step == 3


BAD = [
    ("crash_at_step=x", "LOWPREC_FAULTS.crash_at_step"),
    ("crash_at=3", "LOWPREC_FAULTS"),  # an unknown key, not a silent no-op
    ("kill_at_step", "'kill_at_step' is not key=value"),
    ('{"kill_at_step": 3', "LOWPREC_FAULTS: not a JSON object"),
    ("[3]", "'[3]' is not key=value"),
    ("signal=SIGKILL", "LOWPREC_FAULTS: signal=SIGKILL is not one of SIGTERM, SIGINT, SIGUSR1"),
    ("nan_into=bias", "LOWPREC_FAULTS: nan_into=bias is not one of weight, activation, gradient"),
    ("at_point=save.middle", "LOWPREC_FAULTS: at_point=save.middle is not one of save.start"),
]


@pytest.mark.parametrize("value, needle", BAD, ids=[v for v, _ in BAD])
def test_a_bad_value_is_one_line_and_creates_no_mlflow_run(value, needle, run_dirs, tmp_path, capsys):
    with pytest.raises(ConfigError, match="LOWPREC_FAULTS"):
        parse(value)
    with injected(value):
        assert main(["train", *RUN, *run_dirs]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lowprec train: error: ") and needle in err, err
    db = tmp_path / "runs" / "mlflow.db"
    if db.exists():
        client = MlflowClient(f"sqlite:///{db}")
        assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_a_fault_point_fires_through_the_environment_variable(run_dirs, tmp_path):
    # SIGKILL at the run's creation: the run exists in MLflow and the process never gets further
    cmd = [sys.executable, "-m", "lowprec_lab", "train", *RUN, *run_dirs]
    spec = "at_point=run.created,point_action=kill"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with(spec))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    assert run.info.status == "RUNNING" and not run.data.metrics
