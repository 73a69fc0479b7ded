"""Internal to ``ckpt_store`` (public through ``ckpt_store``: ``MemoryTier``, ``MemoryStep``,
``survives``, ``memory_needed``, ``memory_fits``): checkpoints held in the hosts' memory, each
rank's part also in the next node's (issue 33; docs/design.md §4, "Memory checkpoints").

Modules:

* ``ring``: pure placement math: which node keeps whose replica, what a loss of nodes leaves, the memory a node needs.
* ``dir_store``: one node's memory checkpoints, objects under a tmpfs directory, each whole or absent.
* ``wire``: the transfer service's framing, and its client for one remote node.
* ``server``: a node's transfer server (a process of its own, no torch), and how the trainer starts it.
* ``peer_storage``: the ``peermem://`` storage backend: writes to this node and its replica, reads from any live node.
* ``tier``: ``MemoryTier``: a run's memory store (collective open), and which memory steps the live nodes can restore.
"""
