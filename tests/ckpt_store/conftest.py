"""Fixtures of the ckpt_store tests."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(params=["file", "memory"])
def url(request, tmp_path):
    """A fresh store URL, once on a local disk and once in memory."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt"
    return f"memory://ckpt-{uuid.uuid4().hex[:8]}"
