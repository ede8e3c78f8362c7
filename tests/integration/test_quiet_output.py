"""What a command prints is lowprec's own: no third-party notice a user cannot act on. Each check runs the real
thing (a process group's mesh, torchrun, a new MLflow store, ``data prepare`` from a table source) and reads its
output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from lowprec.data.prepare_source import PrepareSpec, prepare_shards
from lowprec_lab.plan.launch import torchrun_command, torchrun_env

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if k != "PYTHONWARNINGS"}  # python's own warning filters
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_slicing_the_flattened_dp_mesh_prints_no_deprecation_notice(tmp_path):
    p = _python(f"""
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        from lowprec.build_parallel import ParallelPlan
        from lowprec.parallel.dims import ParallelDims, dp_coordinate
        dims = ParallelDims()
        mesh = dims.build_mesh("cpu")
        print(dp_coordinate(mesh), ParallelPlan(dims, mesh, None).dp_mesh.size())
        import warnings
        with warnings.catch_warnings(record=True) as seen:  # the message is ignored for lowprec's slice only
            warnings.simplefilter("always")
            mesh["dp"]
        print(sum("Slicing a flattened dim" in str(w.message) for w in seen))
        dist.destroy_process_group()
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["(0,", "1)", "1", "1"]
    assert "Slicing a flattened dim from root mesh" not in p.stderr, p.stderr


def test_torchrun_prints_no_omp_num_threads_banner(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # tests/conftest.py sets it; a user's shell does not
    env = torchrun_env()
    p = subprocess.run(
        torchrun_command(2, [], module="platform"),  # torchrun says it only for more than one rank
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "OMP_NUM_THREADS" not in p.stderr + p.stdout and "****" not in p.stderr, p.stderr
    assert env["OMP_NUM_THREADS"] == "1"  # torchrun's own default, stated
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert torchrun_env()["OMP_NUM_THREADS"] == "3"  # a value the user set is kept


def test_a_new_mlflow_store_prints_no_table_creation_log(tmp_path, mlflow_makes_new_stores):
    p = _python(f"""
        from lowprec_lab.tracking.tracker import make_tracker
        t = make_tracker("sqlite:///{tmp_path / "mlflow.db"}", "lowprec", "{tmp_path / "runs"}")
        print(t.experiment_id)
    """)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "mlflow.db").is_file()
    assert "database tables" not in p.stderr and "INFO" not in p.stderr, p.stderr


def test_data_prepare_from_jsonl_shows_no_bar_whose_total_is_the_bpe_training_cap(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}: " + "some words " * 40}) + "\n" for i in range(40)))
    prepare_shards(PrepareSpec(source=str(src), out=str(tmp_path / "shards"), vocab_size=300), progress=True)
    err = capsys.readouterr().err
    bpe = [line for line in err.replace("\r", "\n").splitlines() if "training BPE" in line]
    assert bpe, err
    assert not any("500M" in line or "%" in line for line in bpe), bpe  # a count and a rate, no made-up total
