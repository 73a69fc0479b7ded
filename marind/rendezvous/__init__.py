"""etcd v3 rendezvous for torch elastic: ``torchrun --rdzv-backend=etcd3``.

* ``Etcd3RendezvousHandler``: torch's ``RendezvousHandler`` on per-round keys
  (``{prefix}/jobs/{run_id}/rdzv/rounds/{n}/...``): each node writes its own
  key, one closer writes each participant's rank key (``etcd3_handler``, ``rounds``).
* ``Etcd3Store``: the agents' c10d store on etcd (``.../rdzv/store/``).
* ``create_etcd3_handler``: the ``torchrun.handlers`` entry point.
* ``Etcd3RendezvousBackend``, ``Etcd3StateRendezvousHandler``: the earlier
  implementation (torch's handler on one state key), kept as the bench's and
  the tests' point of comparison (``state_handler``).
"""


def create_etcd3_handler(params=None):
    """``create_etcd3_handler(params) -> RendezvousHandler``; also torch's entry point.

    torch's registry calls an entry point with *no* arguments and registers
    what it returns, so without ``params`` this returns itself. It is
    defined before anything imports torch: importing torch's rendezvous
    package loads the entry points, possibly while this module is still
    half-imported.

    Args:
        params: torchrun's ``RendezvousParameters``, or None (torch's registry).

    Returns:
        A rendezvous handler on etcd v3 (``handler.create_handler``), or this
        function itself when ``params`` is None.

    Raises:
        ValueError: a bad ``--rdzv-conf`` option or no endpoint.
        RendezvousConnectionError: etcd cannot be reached with these settings.
    """
    if params is None:
        return create_etcd3_handler
    from marind.rendezvous.handler import create_handler
    return create_handler(params)


from marind.rendezvous.backend import Etcd3RendezvousBackend, state_key  # noqa: E402
from marind.rendezvous.etcd3_handler import Etcd3RendezvousHandler  # noqa: E402
from marind.rendezvous.handler import Etcd3Options, connect, create_handler, parse_options  # noqa: E402
from marind.rendezvous.state_handler import Etcd3StateRendezvousHandler, create_state_handler  # noqa: E402
from marind.rendezvous.store import Etcd3Store, store_base  # noqa: E402

__all__ = [
    "Etcd3Options", "Etcd3RendezvousBackend", "Etcd3RendezvousHandler", "Etcd3StateRendezvousHandler",
    "Etcd3Store", "connect", "create_etcd3_handler", "create_handler", "create_state_handler",
    "parse_options", "state_key", "store_base",
]
