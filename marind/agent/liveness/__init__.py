"""Is a peer alive, and is this node cut off? The data network's liveness and fencing.

The lease in etcd says whether a node's agent reaches the control plane; these modules add
what the lease cannot see (a data network that died while etcd still answers, a host gone
silent) and what a node does when it is the one cut off:

* ``data_probe``: one agent's TCP probes of its job peers' data addresses;
  ``probe_handshake``: telling a peer's probe listener from anything else that answers;
* ``data_decisions``: which node lost the data network, and what this node does (pure);
* ``data_watch``: acting on those decisions for the jobs this node runs;
* ``silence``: a silent host declared lost before its lease expires, when two independent
  signals agree (pure);
* ``fencing``: a node whose lease lapsed stops what ran under it, then registers anew.
"""
