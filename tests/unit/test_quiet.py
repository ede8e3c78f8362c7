"""Exactly the three known third-party import warnings are silenced; other messages of those loggers still show."""

import logging
import subprocess
import sys


def test_known_noise_is_dropped_and_other_messages_are_kept(caplog):
    import lowprec  # noqa: F401  (installs the filters)

    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torchao").warning("Failed to load something else")
        logging.getLogger("torch.utils._pytree").warning("X is an Enum subclass and is now natively supported by ...")
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
        bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "No module")
        bnb.warning("Failed to load CPU something else")
    got = [r.getMessage() for r in caplog.records]
    assert got == ["Failed to load something else", "another pytree warning", "Failed to load CPU something else"]


def test_importing_lowprec_prints_nothing_and_defers_torchao_and_bitsandbytes():
    """torchao and bitsandbytes cost ~2 s of start-up in every process (each rank, each CLI call) and are
    imported only when a recipe's backend needs them; imported after lowprec, as such a run does, they print
    nothing either (one subprocess for both checks: each costs a cold import of torch)."""
    # The same for what a run's process never needs: torch._dynamo (~1 s; imported by torch.compile when a run
    # compiles) and scipy.stats/statsmodels (~0.9 s; the report's statistics), checked on an ablation worker's imports.
    code = (
        "import sys, lowprec.train.build, lowprec.train.loop, lowprec.recipes, lowprec_lab.tracking.tracker, "
        "lowprec_lab.cli, lowprec_lab.runner.scheduler, lowprec_lab.plan.preflight; "
        "print(sorted(m for m in ('torchao', 'bitsandbytes', 'torch._dynamo', 'scipy.stats', 'statsmodels') "
        "if m in sys.modules)); "
        "import torchao.float8, torchao.optim, bitsandbytes"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "[]" and p.stderr == "", (p.stdout, p.stderr)
