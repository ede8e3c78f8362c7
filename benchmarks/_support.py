"""Shared by the benchmarks and the tests that measure the same things: a real ``mlflow server`` that can be
SIGKILLed and restarted (``benchmarks/faults.py``, ``tests/faults/test_tracking_server_down.py``), and the kernel
parity yardstick, a recipe's per-step losses with and without a permuted FP32 reduction order
(``benchmarks/compile_catalog.py``, ``tests/kernels/test_parity.py``, ``tests/kernels/test_compile.py``).

Benchmarks import it as ``_support`` (their own folder is on ``sys.path``), the tests as ``benchmarks._support``
(``python -m pytest`` runs from the repository root)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.numerics.reorder import reversed_reductions
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step
from lowprec_lab.tracking.ui import wait_until_up

#: The parity runs' size: steps, sequences per batch, tokens per sequence (``debug`` model).
STEPS, BATCH, SEQ = 20, 4, 64


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with one worker, job execution off, a sqlite backend store and served
    artifacts, all under ``folder``. ``kill`` SIGKILLs its whole process group (``mlflow server`` runs uvicorn as
    a child process); ``start`` brings it back on the same port and store. ``start`` raises what
    ``lowprec_lab.tracking.ui.wait_until_up`` raises when the server does not come up; ``kill`` raises
    ``RuntimeError`` when the port still answers 30 s after the SIGKILL."""

    def __init__(self, folder):
        self.folder = folder
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.db = folder / "server.db"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server (again) on the same port and store and wait until it answers."""
        cmd = [
            sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.db}",
            "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1",
            "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.folder / "server.log", "a") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
        wait_until_up(self.uri, self.proc)

    def kill(self) -> None:
        """SIGKILL the server's process group and wait until its port is free; a no-op when it is not running."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the uvicorn child dies a moment after: until then it holds the port
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"mlflow server on port {self.port} still answers after SIGKILL")


def train_losses(
    token_data, recipe: str, cpu_kernels: str, reorder: bool = False, steps: int = STEPS, **train
) -> list[float]:
    """Per-step training losses of ``recipe`` on ``debug`` (seed 0, the real corpus ``token_data``), with
    ``cpu_kernels``; ``reorder``: every FP32 matmul of the forward and backward under ``ReversedReductionOrder``
    (the optimizer step runs outside it: torchao's optimizers are compiled, and dynamo does not trace under a
    dispatch mode). ``train``: further ``TrainSpec`` fields (e.g. ``compile=True``)."""
    spec = TrainSpec(steps=steps, batch_size=BATCH, seq_len=SEQ, warmup_steps=2, timing_warmup_steps=1, **train)
    b = build(CATALOG[recipe], model_args("debug"), spec, OptimHParams(), 0, torch.device("cpu"), None, cpu_kernels)
    batches = TokenBatches(token_data.train, token_data.val, SEQ, BATCH, 0)
    if not reorder:
        return [train_step(b, [batches.train_batch(s)], spec.grad_clip, s).loss for s in range(steps)]
    with reversed_reductions(b.optimizer):
        return [train_step(b, [batches.train_batch(s)], spec.grad_clip, s).loss for s in range(steps)]


def max_gap(a: list[float], b: list[float]) -> float:
    """The largest absolute difference between two equally long loss curves."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
