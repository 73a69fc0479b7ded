"""Every replica group a torchft test started is killed afterwards, workers included, pass or fail."""

import pytest

from tests.torchft.groups import kill_all_groups


@pytest.fixture(autouse=True)
def _kill_groups():
    yield
    kill_all_groups()
