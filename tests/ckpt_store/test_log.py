"""ckpt_store's loggers: the application's structlog setup where there is one, else stderr."""

from __future__ import annotations

import json

import pytest
import structlog
from structlog.testing import capture_logs

from ckpt_store.log import get_logger

pytestmark = pytest.mark.unit


@pytest.fixture
def unconfigured():
    """structlog as a process that never configured it (the configuration is restored after)."""
    saved = structlog.get_config()
    was = structlog.is_configured()
    structlog.reset_defaults()
    yield
    if was:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()


def test_without_a_configuration_lines_go_to_stderr_never_stdout(unconfigured, capsys):
    log = get_logger("ckpt_store.x", job="j").bind(rank=1)
    log.info("ckpt_committed", step=3)
    log.debug("not_shown")
    assert not structlog.is_configured(), "ckpt_store must not configure structlog itself"
    out, err = capsys.readouterr()
    assert out == ""
    lines = [json.loads(line) for line in err.splitlines()]
    assert len(lines) == 1
    assert lines[0]["event"] == "ckpt_committed" and lines[0]["level"] == "info"
    assert {"logger": "ckpt_store.x", "job": "j", "rank": 1, "step": 3}.items() <= lines[0].items()


def test_a_configured_application_gets_every_line(unconfigured):
    log = get_logger("ckpt_store.x")      # made before the application configures structlog
    with capture_logs() as seen:
        log.warning("ckpt_skip_step", step=2)
    assert seen == [{"logger": "ckpt_store.x", "step": 2, "event": "ckpt_skip_step", "log_level": "warning"}]
