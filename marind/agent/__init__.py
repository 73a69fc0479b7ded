"""The per-node daemon behind `marind agent` (docs/design.md §1, §2).

Modules, one concept each:

* ``daemon``: the main loop (``Agent``) that ties the rest together;
* ``decisions``: the loop's decisions as pure functions (slots, a terminal job, rounds,
  a torchrun exit, a hang, a lost node, a fence, a lost replica group), each returning
  its reason;
* ``run_monitor``: one supervised job on this node (its torchrun, rounds, restarts, hangs,
  node losses, progress and records); ``launch``: starting it;
* ``fencing``: stopping the runs of a node whose lease lapsed, then rejoining;
* ``worker_errors``: why workers failed (torchrun's log, torchelastic's error file);
* ``doctor_probe``: this node's part in `marind doctor --cluster`;
* ``outbox``: what the agent writes to etcd, in order, surviving an outage;
* ``link``: the etcd client and what hangs off it; ``embedded_etcd``: `--embedded`;
* ``supervisor``: one torchrun process tree (start, workers, stop, reaping leftovers);
* ``torchrun_args``: what a torchrun runs with (run dir, run.toml, command line, environment);
* ``hang``: pure stall detection; ``progress``: workers' progress records;
* ``lifecycle``: the job state enum and the one transition function;
* ``job_records``: a job's keys in etcd, read and written the one way;
* ``change_watch``: when to read the jobs again; ``events``: the bounded event ring;
* ``registry``: node registration under a lease; ``membership``: lost nodes, reported once;
* ``ft_coordinator``: a torchft job's replica-group slot and lighthouse on this node;
  ``ft_pending``: torchft jobs waiting for a slot; ``ft_exits``: when its group ends;
* ``config``: agent settings and the etcd endpoint lookup.
"""
