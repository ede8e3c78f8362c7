"""Both restricted unpicklers (a checkpoint's ``.metadata``, ``lowprec.train.checkpoint_metadata.load_metadata``; a
job's argument file, ``lowprec_lab.runner.job_ranks.load_args``) refuse every global outside their allow-lists, with
real payloads that would write a file: a ``torch`` callable that is not a dtype (``torch.save``), under its own
module and as a global of ``torch``, and ``builtins.getattr``, through which a bound method of an allow-listed value
pickles (``PosixPath(...).touch``). No file appears."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from lowprec.errors import CheckpointError
from lowprec.train.checkpoint_metadata import load_metadata
from lowprec_lab.runner.job_ranks import ARGS, load_args


class _Call:
    """Unpickles as ``fn(*args)``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _torch_global_save(marker: Path) -> bytes:
    """``torch.save({}, marker)`` with ``save`` named as a global of the ``torch`` module (where the dtypes are)."""
    real = pickle.dumps(_Call(torch.save, {}, str(marker)), protocol=2)
    assert b"ctorch.serialization\nsave\n" in real
    return real.replace(b"ctorch.serialization\nsave\n", b"ctorch\nsave\n")


PAYLOADS = {
    "torch.serialization.save": lambda m: pickle.dumps(_Call(torch.save, {}, str(m))),
    "torch.save": _torch_global_save,
    "builtins.getattr": lambda m: pickle.dumps(_Call(Path(m).touch)),  # getattr(PosixPath(m), 'touch')()
}


@pytest.mark.parametrize("name", PAYLOADS)
def test_the_payload_is_real(name, tmp_path):
    """Unpickled without an allow-list, each payload writes its file."""
    marker = tmp_path / "written"
    pickle.loads(PAYLOADS[name](marker))
    assert marker.exists()


@pytest.mark.parametrize("name", PAYLOADS)
def test_checkpoint_metadata_refuses_it_and_nothing_is_written(name, tmp_path):
    marker = tmp_path / "written"
    with pytest.raises(CheckpointError, match="refers to"):
        load_metadata(PAYLOADS[name](marker), str(tmp_path / ".metadata"))
    assert not marker.exists()


@pytest.mark.parametrize("name", PAYLOADS)
def test_a_jobs_argument_file_refuses_it_and_nothing_is_written(name, tmp_path):
    marker = tmp_path / "written"
    job = tmp_path / "job"
    job.mkdir()
    (job / ARGS).write_bytes(PAYLOADS[name](marker))
    with pytest.raises(pickle.UnpicklingError, match="refers to"):
        load_args(job)
    assert not marker.exists()
