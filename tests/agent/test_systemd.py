"""The systemd unit verifies, and the example config parses as an agent config."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from marind.control.config import load_config
from marind.testing.procs import REPO_ROOT

UNIT = REPO_ROOT / "systemd" / "marind.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed (Debian package systemd)")
def test_unit_verifies(tmp_path):
    # point ExecStart at this checkout's console script: verify checks that it is executable
    marind = Path(sys.executable).parent / "marind"
    text = UNIT.read_text().replace("/opt/marind/.venv/bin/marind", str(marind))
    unit = tmp_path / "marind.service"
    unit.write_text(text)
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (res.stdout + res.stderr).splitlines() if "marind.service" in line]
    assert res.returncode == 0 and not problems, res.stdout + res.stderr


@pytest.mark.unit
def test_unit_has_the_promised_settings():
    text = UNIT.read_text()
    for setting in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "KillMode=mixed", "TimeoutStopSec=",
                    "User=marind", "StateDirectory=marind", "ConfigurationDirectory=marind",
                    "NoNewPrivileges=yes", "ProtectSystem=strict", "ReadWritePaths=/var/lib/marind"):
        assert setting in text, setting


@pytest.mark.unit
def test_example_config_loads():
    config = load_config(str(REPO_ROOT / "systemd" / "marind.toml.example"), env={}, flags={})
    assert config.etcd.startswith("http://10.0.0.1:2379") and config.metrics_port == 9465
