"""A watch that tells a cache when to read etcd again, and what it saw (one definition for marind's caches).

``PrefixWatch`` watches the keys under a prefix and keeps, until its owner ``take``\\ s them,
that something changed there (``changed``) and the events themselves. With ``deletes_only``
etcd sends deletes alone, each with the key's last value: what a cache of many records needs
to learn which one went without reading them all again (``marind.agent.membership``); a cache
that only counts (``marind.rendezvous.waiting``) looks at ``changed``.

A stream that breaks (the library passes its error, or None when the stream ended) forgets
the watch: ``live`` is False until ``ensure`` makes a new one, and what changed in between is
in no event, so the owner reads everything again (``ensure`` returns True). The callback holds
a reference to the ``PrefixWatch`` alone, not to its owner, so an owner dropped without
``close`` is still collected.
"""

from __future__ import annotations

import threading
from typing import Any

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient


class PrefixWatch:
    """The changes under ``prefix`` since the owner last took them.

    Args:
        client: the etcd client.
        prefix: the keys watched.
        deletes_only: watch deletes alone, with each key's last value (``EtcdClient.watch_prefix``).
    """

    def __init__(self, client: EtcdClient, prefix: str, *, deletes_only: bool = False) -> None:
        self.client, self.prefix, self.deletes_only = client, prefix, deletes_only
        self.changed = True                 # nothing read yet
        self.watch_id: int | None = None
        self._events: list[Any] = []
        self._broken = False
        self._closed = False
        self._cond = threading.Condition()

    @property
    def live(self) -> bool:
        """A watch is in place (as far as its stream has told)."""
        return self.watch_id is not None

    def __call__(self, response: Any) -> None:
        """The library's callback (on its watch thread): a response with events, or a broken stream."""
        events = getattr(response, "events", None)
        with self._cond:
            self.changed = True
            if events is None:
                self.watch_id, self._broken = None, True
            else:
                self._events.extend(events)
            self._cond.notify_all()

    def ensure(self) -> bool:
        """Watch again when no watch is live (not after ``close``).

        Returns:
            True when a new watch started now: a change before it is in none of its events, so
            the owner reads everything once. False when one was live already or etcd refused
            (``live`` says which).
        """
        if self.watch_id is not None or self._closed:
            return False
        with self._cond:
            self._broken = False
        try:
            watch_id = self.client.watch_prefix(self.prefix, self, deletes_only=self.deletes_only)
        except ControlPlaneUnavailable:
            return False
        with self._cond:
            if not self._broken:         # (a stream that broke at once is not a watch)
                self.watch_id = watch_id
            self.changed = True
        return self.watch_id is not None

    def take(self) -> list[Any]:
        """The events since the last take (``changed`` becomes False)."""
        with self._cond:
            events, self._events, self.changed = self._events, [], False
            return events

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a response (or a broken stream) since the last
        ``take``; whether one came."""
        with self._cond:
            return self._cond.wait_for(lambda: self.changed, timeout)

    def close(self) -> None:
        """Cancel the watch for good."""
        self._closed = True
        watch_id, self.watch_id = self.watch_id, None
        if watch_id is not None:
            self.client.cancel_watch(watch_id)
