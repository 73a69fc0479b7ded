"""``PrefixWatch``: what a watch-driven cache is told (a change, the events, a broken stream)."""

from __future__ import annotations

from marind.core.etcd_watch import PrefixWatch


def test_a_watch_of_deletes_sees_them_alone_with_each_keys_last_value(etcd_client):
    prefix = etcd_client.key("w") + "/"
    watch = PrefixWatch(etcd_client, prefix, deletes_only=True)
    try:
        assert watch.ensure() is True and watch.live and watch.ensure() is False
        watch.take()
        etcd_client.put(prefix + "a", "one")
        etcd_client.put(prefix + "a", "two")
        etcd_client.delete(prefix + "a")
        assert watch.wait(10)
        events = watch.take()
        assert [(e.key, e.prev_value) for e in events] == [(prefix.encode() + b"a", b"two")]
        assert not watch.changed and watch.take() == []
    finally:
        watch.close()


def test_a_broken_stream_forgets_the_watch_and_a_closed_one_stays_closed(etcd_client):
    watch = PrefixWatch(etcd_client, etcd_client.key("w") + "/")
    try:
        assert watch.ensure()
        watch.take()
        watch(None)                       # what the library passes when the stream ends
        assert watch.changed and not watch.live and watch.wait(0)
        assert watch.ensure() is True     # a new watch: the owner reads everything again
    finally:
        watch.close()
    assert watch.ensure() is False and not watch.live
