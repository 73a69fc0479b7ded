"""Every replica group a torchft test started is killed afterwards, workers included, pass or fail;
the ``lighthouse`` fixture: one torchft lighthouse on 127.0.0.1 with ``FAULT``'s settings."""

import pytest

from tests.torchft.groups import FAULT, kill_all_groups


@pytest.fixture(autouse=True)
def _kill_groups():
    yield
    kill_all_groups()


@pytest.fixture
def lighthouse(tmp_path):
    from marind.agent.ft.coordinator import LighthouseProcess
    lh = LighthouseProcess(FAULT, tmp_path / "lighthouse.log", "127.0.0.1")
    lh.start()
    yield lh
    lh.stop()
