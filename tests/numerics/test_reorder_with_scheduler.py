"""``reversed_reductions`` under an LR scheduler: the selfcheck's negative control steps its scheduler inside the
block, where torch warned on every step that ``optimizer.step()`` "has been overridden" (printed in every
``lowprec selfcheck``)."""

import warnings

import torch

from lowprec.numerics.reorder import reversed_reductions


def test_a_scheduler_stepped_inside_the_block_does_not_warn():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with reversed_reductions(opt):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            sched.step()
    assert [str(w.message) for w in caught] == []
    assert sched.last_epoch == 1  # the scheduler counted the step through the wrapper
