"""etcd v3 rendezvous for torch elastic: ``torchrun --rdzv-backend=etcd3``.

* ``Etcd3RendezvousBackend``: torch's ``RendezvousBackend`` on one etcd key
  (``{prefix}/jobs/{run_id}/rdzv/state``), compare-and-set on its mod_revision.
* ``Etcd3Store``: the agents' c10d store on etcd (``.../rdzv/store/``).
* ``create_etcd3_handler``: the ``torchrun.handlers`` entry point.
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
from marind.rendezvous.handler import (  # noqa: E402
    Etcd3Options,
    Etcd3RendezvousHandler,
    connect,
    create_handler,
    parse_options,
)
from marind.rendezvous.store import Etcd3Store, store_base  # noqa: E402

__all__ = [
    "Etcd3Options", "Etcd3RendezvousBackend", "Etcd3RendezvousHandler", "Etcd3Store",
    "connect", "create_etcd3_handler", "create_handler", "parse_options", "state_key",
    "store_base",
]
