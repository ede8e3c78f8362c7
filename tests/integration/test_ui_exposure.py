"""``lowprec ui`` on a network: a host that other machines can reach needs ``--expose`` and says
what it exposes; ports outside 1-65535 and hosts that do not resolve are one line each (not a traceback, not "port
in use"); ``--auth`` runs MLflow's basic-auth app. None of these cases starts a server."""

from __future__ import annotations

import importlib.util

import pytest

from lowprec_lab.cli import main
from lowprec_lab.tracking.ui import check_exposure, is_loopback, ui_command


@pytest.fixture
def db(tmp_path):
    return f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_network_host_without_expose_is_refused_in_one_line(db, capsys, host):
    assert main(["ui", "--host", host, db]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lowprec ui: error: --host {host} serves the tracking store to the network with no login")
    assert "add --expose" in err and "\n" not in err


def test_exposing_says_what_it_exposes():
    said = check_exposure("0.0.0.0", expose=True, auth=False)
    assert "no login (add --auth)" in said and "change or delete them" in said and "DNS rebinding" in said
    assert check_exposure("127.0.0.1", expose=False, auth=False) is None
    assert is_loopback("localhost") and is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("0.0.0.0")


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_a_port_outside_the_tcp_range_is_one_line(db, capsys, port):
    assert main(["ui", "--port", port, db]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lowprec ui: error: argument --port: --port {port!r} is not a TCP port (1-65535)"


def test_a_host_that_does_not_resolve_is_said_as_such_not_as_a_busy_port(db, capsys):
    assert main(["ui", "--host", "no-such-host.invalid", db]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowprec ui: error: --host 'no-such-host.invalid' does not resolve") and "in use" not in err


def test_auth_runs_mlflows_basic_auth_app_and_needs_its_extra_and_a_password(db, capsys, monkeypatch):
    cmd = ui_command("sqlite:///x.db", "0.0.0.0", 5000, auth=True, allowed_hosts="lab.example:5000")
    assert cmd[cmd.index("--app-name") + 1] == "basic-auth"
    assert cmd[cmd.index("--allowed-hosts") + 1] == "lab.example:5000"
    monkeypatch.delenv("MLFLOW_AUTH_ADMIN_PASSWORD", raising=False)
    assert main(["ui", "--auth", db]) == 2
    err = capsys.readouterr().err.strip()
    if importlib.util.find_spec("flask_wtf") is None:
        assert err.startswith("lowprec ui: error: --auth runs MLflow's basic-auth app, which needs Flask-WTF")
    else:
        assert "set MLFLOW_AUTH_ADMIN_PASSWORD" in err
