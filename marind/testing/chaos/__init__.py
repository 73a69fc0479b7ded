"""The library behind the fault injectors in ``chaos/`` (docs/design.md §6).

Each ``chaos/NAME.py`` is a script: ``python chaos/NAME.py --job JOB
[--etcd URL] [--seed N] ...``. It finds its target through etcd, acts only
on processes of this machine, prints one JSON line per action on stdout
and exits 0 when it acted, 1 when it found nothing to act on. What the
scripts share lives here:

* ``common``: arguments, the etcd connection, the output line, exit codes;
* ``targets``: finding workers and agents through etcd, checked against the OS;
* ``servers`` and ``outage``: stopping a server (etcd, S3) and starting the same one again;
* ``ckpt``: reading a checkpoint root's layout without ckpt_store;
* ``schedule``: failure times drawn from a seed;
* ``host_faults``: a bed host's power loss and partitions (``power_off.py``,
  ``partition.py``), found through the bed's state file rather than etcd.
"""
