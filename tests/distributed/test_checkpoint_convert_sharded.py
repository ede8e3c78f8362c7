"""``lowprec checkpoint convert`` of a checkpoint an older lowprec wrote under FSDP2 on 2 ranks (each rank's shards
in its own file, the param groups in byte records): it converts on one process into full tensors of the global
shape, and the converted checkpoint loads into an unsharded model with the same weights, moments and param groups.
The rank function's module imports torch alone, so the spawned ranks start fast."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict


def _save_sharded_old(rank: int, world_size: int, folder: str) -> tuple:
    """On each rank: a Linear layer under FSDP2 and its AdamW state, saved as an older lowprec saved it (DCP given
    the whole state). Returns the full state (on rank 0) as ``(tensors, values)`` by DCP name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.05)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    full_m, full_o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tensors = {f"model.{k}": v for k, v in full_m.items()}
    tensors |= {f"optim.state.{p}.{k}": v for p, s in full_o.get("state", {}).items() for k, v in s.items()}
    group = {k: v for k, v in full_o["param_groups"][0].items()} if full_o else {}
    return tensors, group


def test_a_checkpoint_sharded_across_ranks_converts_into_full_tensors(tmp_path, capsys):
    from lowprec.parallel.spawn import run_ranks
    from lowprec.train.checkpoint import load_checkpoint
    from lowprec.train.checkpoint_metadata import load_metadata
    from lowprec.train.checkpoint_reader import split_state
    from lowprec_lab.cli import main

    old = tmp_path / "sharded"
    want_t, want_group = run_ranks(_save_sharded_old, 2, str(old))[0]
    meta = load_metadata((old / ".metadata").read_bytes(), byte_records=True)
    assert len(meta.state_dict_metadata["model.weight"].chunks) == 2  # one shard per rank
    assert "optim.param_groups.0.lr" in meta.state_dict_metadata  # the old format
    capsys.readouterr()
    assert main(["checkpoint", "convert", str(old), str(tmp_path / "dst")]) == 0
    captured = capsys.readouterr()
    assert "no trainer_state.pt" in captured.out and "source unverified" in captured.out
    assert "warning:" in captured.err and "cannot be verified" in captured.err
    model = torch.nn.Linear(4, 6)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # the moments exist to load into
    assert load_checkpoint(tmp_path / "dst", model, opt) == 0  # no trainer state: step 0
    got_t, _ = split_state(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)))
    assert got_t.keys() == want_t.keys()
    for k in want_t:
        assert torch.equal(got_t[k], want_t[k]), k
    assert got_t["model.weight"].shape == (6, 4)
    got_group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert got_group == {k: v for k, v in want_group.items() if k != "params"}
    assert got_group["betas"] == (0.8, 0.95) and got_group["lr"] == 1e-2
