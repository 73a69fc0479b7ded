"""An S3 that pushes back (503 SlowDown for a window) under saves made while training (issue 32).

Two gloo ranks save every few steps through ``marind.testing.s3_faults.S3FaultProxy`` in front of
the test SeaweedFS. A storm of 503s starts once a first step committed. Saves retry within
botocore's budget (``object_store.S3_RETRIES``); one that cannot finish fails alone, on every
rank alike (or is skipped while the previous one still runs): the loop never stops stepping. Every
step a rank saw committed is still committed and verifies (0 lost), nothing half-written shows,
and the save after the storm commits and loads.
"""

from __future__ import annotations

import threading
import time

import pytest

from ckpt_store import CheckpointStore
from ckpt_store.errors import STORAGE_THROTTLED, failure_kind
from marind.testing.procs import run_torch_workers
from marind.testing.s3_faults import S3FaultProxy, error_body


@pytest.mark.unit
def test_the_proxy_answers_s3s_error_documents_and_checks_its_rules():
    assert b"<Code>SlowDown</Code>" in error_body(503, "/b/k") and b"<Code>InternalError</Code>" in error_body(500, "/")
    proxy = S3FaultProxy("http://127.0.0.1:1")
    for bad in ({"rate": 1.5, "status": 503}, {"status": 503, "duration_s": -1}, {}):
        with pytest.raises(ValueError):
            proxy.inject(**bad)
    rule = proxy.inject(status=503, after_s=100)
    assert not rule.active(time.monotonic(), "GET")       # not yet: the window starts later
    assert failure_kind("An error occurred (SlowDown) when calling the PutObject operation (reached max "
                        "retries: 7): Please reduce your request rate.") == STORAGE_THROTTLED


def _storm_run(s3, tmp_path, storm_s: float, every: int, step_s: float):
    url = s3.url(f"storm-{time.time_ns()}")
    started, stop = tmp_path / "started", tmp_path / "stop"
    with S3FaultProxy(s3.endpoint, seed=7) as proxy:
        opts = proxy.storage_options(s3.storage_options)
        results: list = []
        errors: list = []

        def run() -> None:
            try:
                results.extend(run_torch_workers("tests.ckpt_store.save.storm_workers:save_through_storm", 2,
                                                 timeout=600, url=url, storage_options=opts, every=every,
                                                 step_s=step_s, give_up_s=2.0, started_file=str(started),
                                                 stop_file=str(stop)))
            except BaseException as exc:  # noqa: BLE001 - raised in the test below
                errors.append(exc)
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        deadline = time.monotonic() + 240
        while not started.exists() and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), errors or "no first commit"
        proxy.storm(storm_s)                          # 503 SlowDown to every request for the window
        time.sleep(storm_s + 3.0)
        stop.write_text("")                           # then a little more without it, and the final save
        worker.join(400)
        assert not errors, errors
        hits = proxy.counts["status"]
    return url, results, hits


def test_saves_through_a_503_storm_lose_nothing_and_the_ranks_agree(s3, tmp_path):
    url, results, hits = _storm_run(s3, tmp_path, storm_s=8.0, every=4, step_s=0.15)
    assert hits > 0, "the storm answered no request: it did not happen"
    outcomes = [r["outcomes"] for r in results]
    assert outcomes[0] == outcomes[1], outcomes            # every rank learned each save's outcome
    steps = results[0]["ran"]
    assert [r["ran"] for r in results] == [steps, steps]  # the ranks stepped alike, through the storm
    store = CheckpointStore(url, storage_options=s3.storage_options)
    committed = store.steps()
    seen = [int(s) for s, o in outcomes[0].items() if o == "committed"]
    assert set(seen) <= set(committed), (seen, committed)  # 0 committed checkpoints lost
    assert committed[-1] == steps + 1, (committed, outcomes[0])    # after the storm: saved
    for step in committed:
        report = store.verify(step)
        assert report.ok, (step, report.problems)
    store.close()
