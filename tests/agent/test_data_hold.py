"""When a node fenced for a dead data network starts its job again (``DataNetwork.may_start``): no
prober thread, no etcd (stand-ins for both)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from marind.agent.liveness import data_watch
from marind.agent.liveness.data_probe import PeerState
from marind.agent.liveness.data_watch import DataNetwork, Hold
from marind.core.errors import ControlPlaneUnavailable
from marind.core.log import get_logger

pytestmark = pytest.mark.unit
SINCE = 1000.0
NOW = SINCE + 1 + 10      # a lease TTL (10 s) of answers


class Prober:
    addr = "10.0.0.2"

    def __init__(self):
        self.answering: set[str] = set()
        self.since: dict[str, float] = {}       # when each began to answer every probe (default SINCE + 1)
        self.dropped: list[str] = []

    def states(self, job):
        return {p: PeerState(ok_at=NOW, down_since=None, checked_at=NOW, outcome="ok",
                             up_since=self.since.get(p, SINCE + 1)) for p in self.answering}

    def drop(self, job):
        self.dropped.append(job)

    def jobs(self):
        return []


class Client:
    def __init__(self):
        self.registered = {"a", "c"}
        self.offline = False

    def key(self, *parts):
        return "/".join(parts)

    def get(self, key):
        if self.offline:
            raise ControlPlaneUnavailable("etcd away")
        return (b"{}" if key.split("/")[-1] in self.registered else None), 1


class Registry:
    def __init__(self):
        self.client = Client()


@pytest.fixture
def net(monkeypatch):
    monkeypatch.setattr(data_watch, "link_up", lambda addr: True)
    monkeypatch.setattr(data_watch, "time", SimpleNamespace(time=lambda: NOW))
    n = DataNetwork.__new__(DataNetwork)
    n.node, n.registry, n.prober, n.holds, n.watches, n.steady_s = "b", Registry(), Prober(), {}, {}, 10.0
    n.log = get_logger("test")
    return n


def test_an_isolated_node_rejoins_once_any_peer_answers(net):
    net.holds["j"] = Hold(since=SINCE, peers=("a", "c"))
    assert not net.may_start("j", {})
    net.prober.answering = {"c"}
    assert net.may_start("j", {}) and "j" not in net.holds and net.prober.dropped == ["hold:j"]


def test_a_peer_must_answer_steadily_for_a_lease_ttl(net, monkeypatch):
    """Over a lossy link probes fail and answer by turns: a few answers in a row do not end the hold."""
    net.holds["j"] = Hold(since=SINCE, peers=("a",))
    net.prober.answering = {"a"}
    monkeypatch.setattr(data_watch, "time", SimpleNamespace(time=lambda: SINCE + 1 + 9))
    assert not net.may_start("j", {})
    monkeypatch.setattr(data_watch, "time", SimpleNamespace(time=lambda: NOW))
    assert net.may_start("j", {})


def test_a_node_cut_off_for_a_broken_pair_waits_for_its_partner(net):
    """b could not reach a (a one-way drop between them) but reached c: c answering proves nothing."""
    net.holds["j"] = Hold(since=SINCE, peers=("a", "c"), must=("a",))
    net.prober.answering = {"c"}
    assert not net.may_start("j", {})
    net.registry.client.offline = True          # etcd cannot tell whether a left: keep holding
    assert not net.may_start("j", {})
    net.registry.client.offline = False
    net.prober.answering = {"a", "c"}
    assert net.may_start("j", {})


def test_an_isolated_node_needs_answers_that_began_after_its_hold(net):
    """Answers in a row since before the hold (the peer's probe state carries over) show nothing of this
    node's network now: it reached nobody then."""
    net.holds["j"] = Hold(since=SINCE, peers=("a",))
    net.prober.answering, net.prober.since = {"a"}, {"a": SINCE - 30}
    assert not net.may_start("j", {})


@pytest.mark.parametrize("c_since", [SINCE + 1, SINCE - 30], ids=["c-after-the-hold", "c-all-along"])
def test_a_partner_that_left_the_cluster_is_not_waited_for(net, c_since):
    """c, which b reached all along (its answers began before the hold), is enough once a is gone."""
    net.holds["j"] = Hold(since=SINCE, peers=("a", "c"), must=("a",))
    net.prober.answering, net.prober.since = {"c"}, {"c": c_since}
    net.registry.client.registered = {"c"}      # a's lease is gone (powered off, say)
    assert net.may_start("j", {})
