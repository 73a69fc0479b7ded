"""The outbox: writes in order, held while etcd is away, one bad write never blocking the rest."""

from __future__ import annotations

import pytest

from marind.agent.outbox import Outbox
from marind.core.errors import ControlPlaneUnavailable

pytestmark = pytest.mark.unit


class Link:
    def __init__(self):
        self.up = True
        self.offline_calls = 0

    def offline(self):
        self.up = False
        self.offline_calls += 1


def _outbox(link: Link) -> Outbox:
    return Outbox(object(), "n1", online=lambda: link.up, offline=link.offline)  # type: ignore[arg-type]


def test_writes_go_at_once_while_online_and_wait_in_order_while_offline():
    link, done = Link(), []
    box = _outbox(link)
    box.put("j", lambda: done.append(1))
    assert done == [1] and len(box) == 0
    link.up = False
    box.put("j", lambda: done.append(2))
    box.put("j", lambda: done.append(3))
    assert done == [1] and len(box) == 2
    link.up = True
    assert box.flush() and done == [1, 2, 3] and len(box) == 0


def test_an_outage_mid_flush_keeps_the_failed_write_and_the_rest():
    link, done = Link(), []
    box = _outbox(link)
    etcd = {"up": False}

    def write(n):
        def action():
            if not etcd["up"]:
                raise ControlPlaneUnavailable("etcd away")
            done.append(n)
        return action
    box.put("j", write(1))                      # online: tried at once, fails, held
    assert link.offline_calls == 1 and not link.up and len(box) == 1
    box.put("j", write(2))                      # offline: queued, not tried
    assert link.offline_calls == 1 and len(box) == 2
    assert not box.flush() and done == [] and len(box) == 2
    etcd["up"] = True
    assert box.flush() and done == [1, 2]


def test_a_bad_write_is_dropped_and_the_rest_goes_on():
    link, done = Link(), []
    box = _outbox(link)
    link.up = False

    def bad():
        raise ValueError("not json")
    box.put("j", bad)
    box.put("j", lambda: done.append("after"))
    link.up = True
    assert box.flush() and done == ["after"] and len(box) == 0 and link.up


def test_two_threads_flushing_one_outbox_write_each_action_once_in_order():
    """The scale simulator (and any second thread of an agent) flushes while a put flushes too."""
    import threading
    import time

    link = Link()
    link.up = False
    box = _outbox(link)
    done: list[int] = []
    for i in range(200):
        box.put("j", lambda i=i: (time.sleep(0.0005), done.append(i)))
    link.up = True
    threads = [threading.Thread(target=box.flush) for _ in range(4)]
    for t in threads:
        t.start()
    box.put("j", lambda: done.append(200))
    for t in threads:
        t.join()
    assert done == list(range(201)) and len(box) == 0
