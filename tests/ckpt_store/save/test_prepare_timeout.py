"""An async save does not wait on a silent storage in the caller's thread (``prepare_timeout_s``).

A SIGSTOPped S3 server is silent: connections open (the kernel's backlog) and nothing answers,
as when the network to it is cut without a reset.
"""

from __future__ import annotations

import os
import signal
import socket

import pytest
import torch

from ckpt_store import CheckpointSaveFailed, CheckpointStore
from marind.testing.procs import run_torch_workers


def test_an_async_save_gives_up_on_a_silent_storage_and_the_next_one_saves(s3_private):
    url = s3_private.url("silent")
    store = CheckpointStore(url, storage_options=s3_private.storage_options, prepare_timeout_s=1.0)
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32)}}
    store.save(1, state, async_=False)
    assert s3_private.proc is not None
    pid = s3_private.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(CheckpointSaveFailed, match="did not answer within 1s"):
            store.save(2, state)            # async: the step directory's check is bounded
        with pytest.raises(CheckpointSaveFailed, match="did not answer within 1s"):
            store.save(3, state)            # step 2's check still waits: no second one beside it
    finally:
        os.kill(pid, signal.SIGCONT)
    # a sync save lets the timed-out check end first: it cannot clear or mark a step under this save
    store.save(3, {"model": {"w": state["model"]["w"] + 1}}, async_=False)
    assert store.steps() == [1, 3]
    assert CheckpointStore(url, storage_options=s3_private.storage_options).verify(3).ok


def test_the_bounded_check_still_refuses_a_committed_step(s3_private):
    store = CheckpointStore(s3_private.url("bound"), storage_options=s3_private.storage_options,
                            prepare_timeout_s=5.0)
    state = {"model": {"w": torch.ones(16)}}
    store.save(1, state, async_=False)
    with pytest.raises(Exception, match="already committed"):
        store.save(1, state)                # the bounded check raises what the check raised


@pytest.mark.parametrize("differ", [False, True], ids=["same-arrays", "rank1-differs"])
def test_a_rank_whose_storage_is_silent_fails_the_save_on_every_rank(s3_private, differ):
    """Every rank's readiness rides on the layout all-reduce: rank 0 (storage fine) and rank 1
    (its storage silent) both refuse the save, none waits in a collective, and the layouts
    are not compared while a rank is not ready."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)     # connections open in the kernel's backlog; nothing ever answers
    try:
        options = dict(s3_private.storage_options)
        quiet = {**options, "client_kwargs": {**options["client_kwargs"],
                                              "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}"}}
        results = run_torch_workers("tests.ckpt_store.workers:save_with_a_silent_rank", 2, timeout=120,
                                    url=s3_private.url("silent-rank"), good_options=options,
                                    silent_options=quiet, differ=differ)
    finally:
        silent.close()
    for r in results:
        assert r["raised"] and r["raised"].startswith("CheckpointSaveFailed") and "within 1s" in r["raised"], r
    assert CheckpointStore(s3_private.url("silent-rank"), storage_options=s3_private.storage_options).steps() == []
