"""``lowprec ui``: the MLflow UI on lowprec's tracking store, with settings that suit a 2-core machine.

``mlflow ui`` starts several web workers and a job-execution worker pool by default; on two cores they compete
with any training that runs beside them, and the UI needs neither to browse runs. lowprec starts it with one
worker and job execution off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``), lists the ablations in the store,
and stops the server on Ctrl-C.

The UI reads and writes every run of the store, and MLflow's server has no login unless its basic-auth app runs. So
it binds ``127.0.0.1`` by default; a host that other machines can reach needs ``--expose`` (and says what it
exposes), and ``--auth`` runs MLflow's basic-auth app (``mlflow server --app-name basic-auth``, which needs
``mlflow[auth]`` and ``MLFLOW_AUTH_ADMIN_PASSWORD`` on first start). MLflow's own host-header and CORS checks
(``--allowed-hosts``, ``--cors-allowed-origins``, on by default since MLflow 3.5) stay on; they stop DNS rebinding
from a browser, not a direct request with a forged ``Host`` header.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from lowprec.errors import UserError
from lowprec_lab.tracking.tracker import ABLATION_TAG, DESCRIPTION_TAG, TrackingError, is_server, resolve_uri

USAGE = (
    "lowprec ui [--host 127.0.0.1] [--port 5000] [--expose] [--auth] [--allowed-hosts H1,H2] "
    "[tracking.uri=...] [tracking.experiment=...]"
)


class PortInUseError(UserError, OSError):
    """The port asked for is taken by another program."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1): a server there is reachable from this
    machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str) -> None:
    """Raises ``UserError`` when ``host`` does not resolve to an address (a typo, not a busy port)."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {host!r} does not resolve to an address ({getattr(e, 'strerror', e)})") from None


def check_exposure(host: str, expose: bool, auth: bool) -> str | None:
    """What serving on ``host`` exposes, as a warning line, or ``None`` for a loopback host. Raises ``UserError``
    for a host other machines can reach without ``expose``, and for ``auth`` without MLflow's auth extra."""
    if auth and importlib.util.find_spec("flask_wtf") is None:
        raise UserError("--auth runs MLflow's basic-auth app, which needs Flask-WTF: pip install 'mlflow[auth]'")
    if is_loopback(host):
        return None
    login = "behind MLflow's basic-auth login" if auth else "with no login (add --auth)"
    if not expose:
        raise UserError(
            f"--host {host} serves the tracking store to the network {login}: whoever reaches the port can read "
            "every run and artifact and change or delete them; add --expose to do so"
        )
    return (
        f"serving the store on {host} to the network {login}: whoever reaches the port can read every run and "
        "artifact" + ("" if auth else " and change or delete them") + "; MLflow's --allowed-hosts check stops DNS "
        "rebinding from browsers, not direct requests"
    )


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port {text!r} is not a TCP port (1-65535)")
    return port


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"lowprec ui: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def check_port_free(host: str, port: int) -> None:
    """Raises ``PortInUseError`` if ``host:port`` cannot be bound (another server holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as uvicorn binds: connections in TIME_WAIT from an earlier server do not make the port busy
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(
                f"port {port} on {host} is in use ({e.strerror}); pass --port N with a free port"
            ) from None


def ablations_in(uri: str, experiment: str) -> list[tuple[str, str, str]]:
    """(ablation id, status, description) of every ablation parent run in ``experiment`` of the store at ``uri``,
    newest first; empty when the experiment does not exist yet."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs(
        [exp.experiment_id], "tags.`lowprec.kind` = 'ablation'", order_by=["attributes.start_time DESC"]
    )
    return [(r.data.tags[ABLATION_TAG], r.info.status, r.data.tags.get(DESCRIPTION_TAG, "")) for r in runs]


def ui_command(uri: str, host: str, port: int, auth: bool = False, allowed_hosts: str | None = None) -> list[str]:
    """The ``mlflow ui`` command line lowprec runs: one web worker, the store's own artifacts; ``auth``: MLflow's
    basic-auth app; ``allowed_hosts``: MLflow's Host-header allow-list (its default otherwise)."""
    cmd = [
        sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    if auth:
        cmd += ["--app-name", "basic-auth"]
    if allowed_hosts:
        cmd += ["--allowed-hosts", allowed_hosts]
    return cmd


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM it when lowprec dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``), so no orphaned server keeps the port. Elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def wait_until_up(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Poll ``url/health`` until it answers; raises ``TrackingError`` if the server exits or never answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TrackingError(f"mlflow ui exited with code {proc.returncode} before it answered at {url}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TrackingError(f"mlflow ui did not answer at {url} within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> int:
    """SIGTERM the server (the signal ``mlflow ui`` shuts down cleanly on), SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt  # a supervisor's SIGTERM stops the UI the way Ctrl-C does


def ui_main(argv: list[str], tracking_of) -> int:
    """Run ``lowprec ui``; ``tracking_of(overrides)`` is the ``tracking`` node (``TrackingConfig``) of the ``ablate``
    config with the ``key=value`` overrides (the store's URI), a bad one a ``UserError``. Returns 0 after Ctrl-C,
    2 with one line on bad input (a port in use, a server URI)."""
    p = _OneLineParser(prog="lowprec ui", usage=USAGE)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=5000)
    p.add_argument("--expose", action="store_true", help="allow a host that other machines can reach")
    p.add_argument("--auth", action="store_true", help="MLflow's basic-auth login (mlflow[auth])")
    p.add_argument("--allowed-hosts", default=None, help="MLflow's Host-header allow-list")
    try:
        args, overrides = p.parse_known_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        tracking = tracking_of(overrides)
        uri = resolve_uri(tracking.uri)
        if is_server(uri):
            raise UserError(f"tracking.uri={uri} is already a server: open it in a browser")
        check_host(args.host)
        exposed = check_exposure(args.host, args.expose, args.auth)
        if args.auth and not os.environ.get("MLFLOW_AUTH_ADMIN_PASSWORD"):
            raise UserError(
                "--auth: set MLFLOW_AUTH_ADMIN_PASSWORD (the admin's password MLflow creates on first start)"
            )
        check_port_free(args.host, args.port)
        found = ablations_in(uri, tracking.experiment)
    except UserError as e:
        print(f"lowprec ui: error: {e}", file=sys.stderr)
        return 2
    if exposed:
        print(f"lowprec ui: warning: {exposed}", file=sys.stderr)
    url = f"http://{args.host}:{args.port}"
    if ":" in args.host:
        url = f"http://[{args.host}]:{args.port}"
    print(f"store: {uri} (experiment {tracking.experiment}); {len(found)} ablation(s)")
    for abl, status, desc in found:
        print(f"  {abl}  {status:<8} {desc}")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    # Its own process group: a Ctrl-C reaches lowprec, which stops the server once, in order.
    proc = subprocess.Popen(
        ui_command(uri, args.host, args.port, args.auth, args.allowed_hosts),
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    try:
        wait_until_up(url, proc)
        print(f"MLflow UI: {url}  (Ctrl-C stops it)", flush=True)
        proc.wait()
        print(f"lowprec ui: error: mlflow ui exited with code {proc.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        stop(proc)
        print("lowprec ui: stopped", flush=True)
        return 0
    except TrackingError as e:
        stop(proc)
        print(f"lowprec ui: error: {e}", file=sys.stderr)
        return 2
    finally:
        stop(proc)
