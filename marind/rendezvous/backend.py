"""torch elastic's ``RendezvousBackend`` on etcd v3 (the earlier handler's; ``state_handler``).

torchrun's ``--rdzv-backend=etcd3`` no longer uses it: every join rewrites
the whole state here, O(N²) bytes a round (``etcd3_handler`` has per-round
keys instead). It stays for ``marind.rendezvous.state_handler``, the point
of comparison of the bench and the tests.

The whole rendezvous state (an opaque byte string that torch's
``DynamicRendezvousHandler`` serialises) lives in one key,
``{prefix}/jobs/{run_id}/rdzv/state``. Its fencing token is the key's
``mod_revision``; ``set_state`` is one etcd transaction that writes only
if the revision is unchanged and otherwise returns the value that won,
so a lost race costs no second round trip and cannot read a newer state
than the one that beat us. An etcd outage is retried for ``grace`` seconds
(``--rdzv-conf etcd_grace_timeout``) before RendezvousConnectionError.

etcd v3 stores bytes, so unlike torch's v2 and c10d backends the state is
kept raw, not base64.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.rdzv_keys import state_key
from marind.rendezvous.retry import DEFAULT_GRACE, with_grace


class Etcd3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd v3 key, compare-and-set on its mod_revision.

    Args:
        client: the etcd client (its prefix applies).
        run_id: the rendezvous (job) id.
        grace: seconds an etcd outage is retried before RendezvousConnectionError.

    Raises:
        ValueError: ``run_id`` is empty.
    """

    def __init__(self, client: EtcdClient, run_id: str, grace: float = DEFAULT_GRACE) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._run_id = run_id
        self._grace = grace
        self.key = state_key(client, run_id)

    @property
    def name(self) -> str:
        """``"etcd3"``."""
        return "etcd3"

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state and its fencing token (the key's mod_revision).

        Returns:
            ``(state, token)``, or None when no state was written yet.

        Raises:
            RendezvousConnectionError: etcd unreachable for longer than the grace.
            RendezvousStateError: the key holds an empty value.
        """
        try:
            value, mod_revision = with_grace(lambda: self._client.get(self.key), self._grace,
                                             "rdzv get_state")
        except ControlPlaneUnavailable as exc:
            raise RendezvousConnectionError(self._connection_message(exc)) from exc
        if value is None:
            return None
        return self._checked(value), mod_revision

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the key is still at ``token`` (create it when ``token`` is None).

        Args:
            state: torch's serialised rendezvous state.
            token: the token ``get_state``/``set_state`` returned last, or None to create.

        Returns:
            ``(state now in etcd, its token, whether ours was written)``: on a lost race,
            the state that won; None when there is no state (lost to a delete, or a
            foreign token and no state).

        Raises:
            RendezvousConnectionError: etcd unreachable for longer than the grace.
            RendezvousStateError: the key holds an empty value.
        """
        if token is None:
            expected = 0  # create: only if no state exists yet
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            expected = token
        else:
            # a token that did not come from this backend cannot match: report the state
            current = self.get_state()
            return None if current is None else (*current, False)
        try:
            ok, value, mod_revision = with_grace(
                lambda: self._client.compare_and_swap_value(self.key, state, expected),
                self._grace, "rdzv set_state")
        except ControlPlaneUnavailable as exc:
            raise RendezvousConnectionError(self._connection_message(exc)) from exc
        if value is None:  # lost the race against a delete: there is no state to return
            return None
        return self._checked(value), mod_revision, ok

    def _checked(self, value: bytes) -> bytes:
        if not value:
            raise RendezvousStateError(
                f"The rendezvous state at {self.key} is empty (corrupt); delete the key "
                "to start the rendezvous afresh.")
        return value

    def _connection_message(self, exc: Exception) -> str:
        return (f"The rendezvous '{self._run_id}' cannot reach etcd at "
                f"{self._client.endpoints_spec} for {self._grace:g}s "
                f"(--rdzv-conf etcd_grace_timeout): {exc}")
