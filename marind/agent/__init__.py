"""The per-node daemon behind `marind agent` (docs/design.md §1, §2).

It builds on ``marind.control`` (job records, states, events, the config file and the endpoint
lookup, which the CLI uses too); nothing outside the agent imports it but ``marind agent`` itself.

Modules, one concept each:

* ``daemon``: the main loop (``Agent``) that ties the rest together;
* ``decisions``: the loop's decisions as pure functions (slots, a terminal job, rounds,
  a torchrun exit, a hang, a lost node, a fence, a lost replica group), each returning
  its reason;
* ``run_monitor``: one supervised job on this node (its torchrun, rounds, restarts, hangs,
  node losses, progress and records), its state behind its methods; ``launch``: starting it;
  its parts: ``run_progress`` (step, stalls, checkpoint commits, per-job metrics),
  ``hang_kill`` (a hung round's stacks dumped, then its workers killed) and ``node_losses``
  (acting on another node's loss);
* ``worker_errors``: why workers failed (torchrun's log, torchelastic's error file);
  ``failure_watch``: each failed round's cause, the first failed rank's own (its words from
  ``marind.control.failure_causes``); ``oom_watch``: the OOM killer told from another SIGKILL;
* ``run_history``: rank 0's reports as curves (``tb_events``: TensorBoard files; ``wandb_sink``:
  the W&B helper process), non-finite losses and rollbacks as events;
* ``doctor_probe``: this node's part in `marind doctor --cluster`;
* ``outbox``: what the agent writes to etcd, in order, surviving an outage;
* ``job_trust``: which jobs the agent agrees to run (only signed ones, when its config says so);
* ``link``: the etcd client and what hangs off it; ``embedded_etcd``: `--embedded`;
* ``supervisor``: one torchrun process tree (start, workers, stop, reaping leftovers);
  ``output_relay``: the process that puts torchrun's output into its log (a full disk drops it,
  never fails a write of torchrun's);
* ``state_dir``: the state dir filling up, as pure decisions (full, back, may a job start);
  ``state_dir_watch``: the agent's looks at it and what it says of it (events, node record, gauge);
* ``torchrun_args``: what a torchrun runs with (run dir, run.toml, command line, environment);
* ``hang``: pure stall detection; ``progress``: workers' progress records;
* ``registry``: node registration under a lease; ``membership``: lost nodes, reported once;
* ``metrics``: the Prometheus endpoint; ``sdnotify``: systemd's readiness and watchdog;
* ``job_journal``: where global rank 0 runs, the job's progress, curves and goodput ledger in etcd.

Packages:

* ``liveness/``: the data network's liveness (probes, decisions, the watch), silent hosts,
  and fencing a node whose lease lapsed;
* ``ft/``: torchft jobs: the replica-group slot and lighthouse, jobs waiting for one, group ends;
* ``warm_start/``: the per-job zygote that forks workers with torch imported.
* ``page/``: the job page on the metrics port (the cluster, one job's curves, events and ledger).
"""
