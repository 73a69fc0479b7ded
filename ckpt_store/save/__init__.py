"""Internal to ``ckpt_store``: one save, from the caller's snapshot to rank 0's commit.

The caller blocks only for the snapshot; a writer (a thread, or a process of its own) does
the rest; a step is visible only once rank 0's manifest is written under the fence.

Modules:

* ``commit``: the commit protocol's markers and its commit: rank 0 commits, the other ranks wait for it.
* ``fence``: the commit fence: rank 0 writes a manifest only while its world may still commit.
* ``gather``: Small sharded arrays are gathered whole before the snapshot and written as one object.
* ``handoff``: the handoff of a snapshot from the saving caller to its writer, while the copy is made.
* ``pending``: PendingSave: the handle of one save, shared by the caller, its snapshot copy and its writer.
* ``rank_part``: One rank's background part of a save: its chunk objects, its values, its object list, its done marker.
* ``save_job``: SaveJob: what ``CheckpointStore.save`` hands its writer, and the writer's interface.
* ``settle``: the ranks agree on the outcome of the save in flight: a failure on one rank is a failure on all.
* ``snapshot``: the snapshot: copy the chunks this rank writes into reused host memory.
* ``snapshot_copy``: the caller's side of a save's snapshot: hand the job to the writer, then copy, then check.
* ``thread_writer``: the in-process writer: a save's background part on a thread (``writer="thread"``).
* ``writer_client``: the training process's side of the writer process: start it, send it jobs, read its replies.
* ``writer_process``: the writer process: runs each rank's background save part outside the training process.
"""
