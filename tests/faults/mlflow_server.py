"""A real ``mlflow server`` for the fault tests: started on a fixed port and store, SIGKILLed, restarted on both."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from experiments.tracking.ui import wait_until_up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with one worker, job execution off, a sqlite backend store and served
    artifacts, all under ``folder``. ``kill`` SIGKILLs its whole process group (``mlflow server`` runs uvicorn as
    a child process); ``start`` brings it back on the same port and store."""

    def __init__(self, folder):
        self.folder = folder
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.db = folder / "server.db"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
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
