"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): model (parameters and buffers, so FP8
amax histories and scales), optimizer state and the step, in one folder.

DCP works without a process group (one process) and with FSDP2 (each rank writes its shards).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing or cannot be loaded into this model; the message says which."""


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Write model, optimizer and ``step`` to the folder ``path`` (created if needed)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=str(path))


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the folder ``path`` into ``model`` and ``optimizer`` in place; returns the saved step.

    Raises ``CheckpointError`` for a missing folder or a checkpoint that does not match the model.
    """
    path = Path(path)
    if not (path / ".metadata").exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (missing .metadata)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # DCP raises CheckpointException/RuntimeError with per-key details
        raise CheckpointError(f"checkpoint {str(path)!r} does not load into this model: {str(e).splitlines()[0]}") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])
